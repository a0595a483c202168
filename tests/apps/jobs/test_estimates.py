"""The queue's start estimates (apps/jobs/estimates.py): examples, then its invariants.

Plain data in and out: no database, no Django.
"""

from hypothesis import given
from hypothesis import strategies as st

from apps.jobs.estimates import ANY_GPU, RESERVED, Queued, estimate_starts

NOW = 1_796_126_400.0  # 2026-12-01 12:00 UTC
HOUR = 3600


def starts(queue, *, capacity, releases=None):
    found = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases or {})
    return {job_id: estimate.start for job_id, estimate in found.items()}


def test_a_job_that_fits_now_starts_now():
    assert starts([Queued(1, "H100", 8, HOUR)], capacity={"H100": 16}) == {1: NOW}


def test_a_job_waits_for_the_running_job_whose_time_limit_frees_its_gpus():
    # 16 H100s, 16 held: 8 back in 2 h, 8 in 3 h.
    releases = {"H100": [(NOW + 3 * HOUR, 8), (NOW + 2 * HOUR, 8)]}
    found = starts([Queued(1, "H100", 8, HOUR)], capacity={"H100": 16}, releases=releases)
    assert found == {1: NOW + 2 * HOUR}


def test_jobs_ahead_take_their_gpus_for_their_time_limits_in_queue_order():
    releases = {"H100": [(NOW + HOUR, 16)]}
    queue = [
        Queued(1, "H100", 16, 4 * HOUR),  # from 1 h to 5 h: all of them
        Queued(2, "H100", 8, HOUR),  # then 5 h
        Queued(3, "H100", 8, HOUR),  # 5 h too: the other 8
        Queued(4, "H100", 8, HOUR),  # 6 h, when job 2 ends
    ]
    found = starts(queue, capacity={"H100": 16}, releases=releases)
    assert found == {1: NOW + HOUR, 2: NOW + 5 * HOUR, 3: NOW + 5 * HOUR, 4: NOW + 6 * HOUR}


def test_a_small_job_does_not_jump_a_larger_one_ahead_of_it():
    # First come, first served: 8 GPUs are free now, but job 1 waits for all 16 (2 h to
    # 3 h), and job 2 behind it.
    releases = {"H100": [(NOW + 2 * HOUR, 8)]}
    queue = [Queued(1, "H100", 16, HOUR), Queued(2, "H100", 8, HOUR)]
    found = starts(queue, capacity={"H100": 16}, releases=releases)
    assert found == {1: NOW + 2 * HOUR, 2: NOW + 3 * HOUR}


def test_types_are_apart_and_a_job_of_any_type_waits_behind_every_job():
    queue = [
        Queued(1, "H100", 8, 2 * HOUR),
        Queued(2, "A100", 8, HOUR),
        Queued(3, "A100", 8, HOUR),  # behind job 2 on the A100s: 1 h
        Queued(4, ANY_GPU, 16, HOUR),  # 16 of the 16: when jobs 1 and 3 have ended
    ]
    found = starts(queue, capacity={"H100": 8, "A100": 8})
    assert found == {1: NOW, 2: NOW, 3: NOW + HOUR, 4: NOW + 2 * HOUR}


def test_nothing_bounds_a_job_larger_than_its_type_or_of_a_type_not_there():
    queue = [Queued(1, "H100", 32, HOUR), Queued(2, "B200", 8, HOUR), Queued(3, "H100", 8, HOUR)]
    found = estimate_starts(queue, now=NOW, capacity={"H100": 16}, releases={})
    assert found[1].start is None and "fewer than 32 H100 GPUs" in found[1].basis
    assert found[2].start is None
    assert found[3].start == NOW  # the jobs it can never start hold nothing


def test_the_schedulers_reservation_is_shown_and_the_jobs_behind_follow_it():
    releases = {"H100": [(NOW + HOUR, 16)]}
    queue = [Queued(1, "H100", 16, HOUR, reserved_at=NOW + 2 * HOUR), Queued(2, "H100", 8, HOUR)]
    found = estimate_starts(queue, now=NOW, capacity={"H100": 16}, releases=releases)
    assert found[1].start == NOW + 2 * HOUR and found[1].basis == RESERVED
    assert found[2].start == NOW + 3 * HOUR
    assert "1 pending job ahead of it of this type" in found[2].basis


def test_a_job_past_its_time_limit_gives_its_gpus_back_now():
    releases = {"H100": [(NOW - HOUR, 8)]}
    assert starts([Queued(1, "H100", 8, HOUR)], capacity={"H100": 8}, releases=releases) == {1: NOW}


# --- invariants over generated fleets and queues --------------------------------------------

TYPES = ["H100", "A100"]


@st.composite
def fleets(draw):
    capacity = {t: draw(st.integers(0, 6)) * 8 for t in TYPES}
    releases = {}
    for t, size in capacity.items():
        held = draw(st.integers(0, size // 8))
        releases[t] = [
            (NOW + draw(st.integers(-2, 48)) * 600, draw(st.sampled_from([1, 2, 4, 8])))
            for _ in range(held)
        ]
    queue = [
        Queued(
            job_id=i,
            gpu_type=draw(st.sampled_from([*TYPES, ANY_GPU])),
            gpus=draw(st.sampled_from([1, 2, 4, 8, 16, 32])),
            time_limit_s=draw(st.integers(1, 48)) * 600,
        )
        for i in range(draw(st.integers(0, 25)))
    ]
    return capacity, releases, queue


@given(fleets())
def test_an_estimate_never_precedes_now_and_none_means_the_job_can_never_fit(fleet):
    capacity, releases, queue = fleet
    found = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases)
    assert set(found) == {job.job_id for job in queue}
    for job in queue:
        start = found[job.job_id].start
        size = sum(capacity.values()) if job.gpu_type == ANY_GPU else capacity[job.gpu_type]
        assert (start is None) == (job.gpus > size)
        assert start is None or start >= NOW
        assert found[job.job_id].basis


@given(fleets())
def test_a_job_ahead_never_starts_later_than_one_behind_it_of_its_type(fleet):
    capacity, releases, queue = fleet
    found = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases)
    for t in TYPES:
        started = [found[j.job_id].start for j in queue if j.gpu_type == t]
        started = [s for s in started if s is not None]
        assert started == sorted(started)


@given(fleets())
def test_at_no_moment_do_the_estimates_hold_more_gpus_than_there_are(fleet):
    capacity, releases, queue = fleet
    found = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases)
    for t in TYPES:
        spans = [(NOW, max(when, NOW), gpus) for when, gpus in releases[t]]
        spans += [
            (found[j.job_id].start, found[j.job_id].start + j.time_limit_s, j.gpus)
            for j in queue
            if j.gpu_type == t and found[j.job_id].start is not None
        ]
        for moment in {start for start, _, _ in spans}:
            held = sum(gpus for start, end, gpus in spans if start <= moment < end)
            assert held <= capacity[t]


@given(fleets(), st.integers(0, 24))
def test_a_job_added_behind_the_queue_moves_no_estimate_ahead_of_it(fleet, extra_gpus):
    capacity, releases, queue = fleet
    before = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases)
    behind = Queued(len(queue), "H100", max(1, extra_gpus), HOUR)
    after = estimate_starts([*queue, behind], now=NOW, capacity=capacity, releases=releases)
    assert all(after[j.job_id] == before[j.job_id] for j in queue)


@given(fleets(), st.data())
def test_reservations_are_shown_as_given_and_no_job_behind_starts_before_them(fleet, data):
    capacity, releases, queue = fleet
    queue = [
        job._replace(reserved_at=NOW + data.draw(st.integers(-6, 48)) * 600)
        if data.draw(st.booleans())
        else job
        for job in queue
    ]
    found = estimate_starts(queue, now=NOW, capacity=capacity, releases=releases)
    for job in queue:
        start = found[job.job_id].start
        assert start is None or start >= NOW
        if start is not None and job.reserved_at is not None and job.reserved_at >= NOW:
            assert start == job.reserved_at and found[job.job_id].basis == RESERVED
    for t in TYPES:
        modelled = [
            found[j.job_id].start
            for j in queue
            if j.gpu_type == t and found[j.job_id].basis != RESERVED
        ]
        modelled = [s for s in modelled if s is not None]
        assert modelled == sorted(modelled)
        floor = NOW
        for j in queue:
            start = found[j.job_id].start
            if j.gpu_type != t or start is None:
                continue
            if found[j.job_id].basis == RESERVED:
                floor = max(floor, start)
            else:
                assert start >= floor
