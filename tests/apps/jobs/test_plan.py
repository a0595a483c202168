"""The planner, `plan(snapshot) -> decisions`: one example per rule, then its invariants.

Plain data in and out: no database, no Django.
"""

import time
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from apps.jobs.scheduler.plan import clock, plan
from apps.jobs.scheduler.priority import fair_share_factors, queue_order
from apps.jobs.scheduler.snapshot import (
    ANY_GPU,
    BEYOND_DEPTH,
    CLOUD,
    OWNED,
    OWNED_THEN_CLOUD,
    NodeSlot,
    Pending,
    PlanSettings,
    PoolInfo,
    Quota,
    Running,
    Snapshot,
    Window,
)

NOW = 1_796_126_400.0  # 2026-12-01 12:00 UTC
HOUR = 3600.0


# --- builders -------------------------------------------------------------------------------


def owned(pool_id=1, gpu_type="H100", **kw) -> PoolInfo:
    return PoolInfo(id=pool_id, kind="owned", gpu_type=gpu_type, spot=False, enabled=True, **kw)


def cloud(pool_id=9, gpu_type="H100", *, spot=True, max_nodes=4, burst_delay_s=600, **kw):
    return PoolInfo(
        id=pool_id,
        kind="cloud",
        gpu_type=gpu_type,
        spot=spot,
        enabled=True,
        max_nodes=max_nodes,
        burst_delay_s=burst_delay_s,
        **kw,
    )


def node(
    node_id, *, pool=1, rack=1, total=8, schedulable=True, shared=True, degraded=False
) -> NodeSlot:
    """A node spec; its free GPUs are worked out from the running jobs by `snap`. Shared by
    default: the examples of the rules that tenancy leaves alone mix teams on nodes."""
    return NodeSlot(
        id=node_id,
        pool_id=pool,
        rack_id=rack,
        gpus_total=total,
        gpus_free=total,
        schedulable=schedulable,
        shared=shared,
        degraded=degraded,
    )


def job(
    job_id,
    *,
    team=1,
    priority=1,
    nodes=1,
    gpus=8,
    gpu_type="H100",
    placement=OWNED,
    limit=HOUR,
    waited=60.0,
    spot=False,
    budget_ok=True,
    min_nodes=0,
    node_ids=None,
) -> Pending:
    return Pending(
        job_id=job_id,
        team_id=team,
        priority=priority,
        queued_at=NOW - waited,
        gpu_type=gpu_type,
        nodes=nodes,
        gpus_per_node=gpus,
        placement=placement,
        spot_allowed=spot,
        time_limit_s=int(limit),
        budget_ok=budget_ok,
        min_nodes=min_nodes,
        node_ids=None if node_ids is None else frozenset(node_ids),
    )


def run(
    job_id,
    node_gpus,
    *,
    team=5,
    priority=1,
    pool=1,
    gpu_type="H100",
    ends_in=HOUR,
    preemptible=True,
) -> Running:
    return Running(
        job_id=job_id,
        team_id=team,
        gpu_type=gpu_type,
        priority=priority,
        pool_id=pool,
        node_gpus=tuple(node_gpus),
        expected_end=NOW + ends_in,
        preemptible=preemptible,
    )


def snap(nodes, pending, *, pools=None, running=(), **kw) -> Snapshot:
    held: dict[int, int] = {}
    for r in running:
        for node_id, gpus in r.node_gpus:
            held[node_id] = held.get(node_id, 0) + gpus
    nodes = tuple(n._replace(gpus_free=max(n.gpus_total - held.get(n.id, 0), 0)) for n in nodes)
    if pools is None:
        pools = {pid: owned(pid) for pid in sorted({n.pool_id for n in nodes})}
    return Snapshot(
        now=NOW,
        nodes=nodes,
        pools=pools,
        running=tuple(running),
        pending=tuple(pending),
        **kw,
    )


def placed(decisions) -> dict[int, tuple]:
    """job id -> its node GPUs."""
    return {p.job_id: p.node_gpus for p in decisions.placements}


def nodes_of(decisions, job_id) -> list[int]:
    return sorted(n for n, _ in placed(decisions)[job_id])


# --- 1. queue order ---------------------------------------------------------------------------


def test_priority_class_comes_before_fair_share_and_age():
    s = snap(
        [node(1)],
        [job(1, priority=0, team=1, waited=6 * 86400), job(2, priority=2, team=2)],
        usage={1: 0.0, 2: 1e9},
    )
    assert queue_order(s)[0].job_id == 2
    assert plan(s).order == [2, 1]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # class
            st.integers(1, 3),  # team: few, so scores tie
            st.sampled_from([60.0, 3600.0, 30 * 86400.0, 60 * 86400.0]),  # waited (ages cap)
        ),
        max_size=40,
    ),
    st.dictionaries(st.integers(1, 3), st.sampled_from([0.0, 100.0, 400.0])),
)
def test_queue_order_is_class_then_score_then_age_then_id(rows, usage):
    """The two sorts and the tie walk give exactly the order of one sort on the whole key."""
    from apps.jobs.scheduler.priority import priority_scores

    pending = [
        job(job_id, priority=c, team=team, waited=waited)
        for job_id, (c, team, waited) in zip(range(100, 0, -1), rows, strict=False)
    ]
    s = snap([node(1)], pending, usage=usage)
    score = priority_scores(s)
    expected = sorted(pending, key=lambda j: (-j.priority, -score[j.job_id], j.queued_at, j.job_id))
    assert [j.job_id for j in queue_order(s)] == [j.job_id for j in expected]


def test_fair_share_factor_is_slurms_classic_formula():
    factors = fair_share_factors(usage={1: 300.0, 2: 100.0}, shares={1: 1, 2: 1}, teams={1, 2, 3})
    # U1 = 0.75, S1 = 1/3: F = 2^-(2.25); U3 = 0 -> 1.
    assert factors[1] == 2 ** -(0.75 / (1 / 3))
    assert factors[2] == 2 ** -(0.25 / (1 / 3))
    assert factors[3] == 1.0
    assert fair_share_factors(usage={}, shares={}, teams={1})[1] == 1.0


def test_a_team_that_used_less_goes_first_within_a_class():
    s = snap([node(1)], [job(1, team=1), job(2, team=2)], usage={1: 500.0, 2: 100.0})
    assert plan(s).order == [2, 1]


def test_a_bigger_share_offsets_usage():
    s = snap(
        [node(1)],
        [job(1, team=1), job(2, team=2)],
        usage={1: 500.0, 2: 100.0},
        shares={1: 10.0, 2: 1.0},
    )
    assert plan(s).order == [1, 2]


def test_age_raises_priority_and_stops_at_max_age():
    settings = PlanSettings(max_age_s=1000.0)
    s = snap(
        [node(1)],
        [job(1, waited=10), job(2, waited=500), job(3, waited=5000), job(4, waited=9000)],
        settings=settings,
    )
    # 3 and 4 are both past max_age: equal scores, so the one queued first (4) leads.
    assert plan(s).order == [4, 3, 2, 1]


def test_ties_are_broken_by_queued_at_then_job_id():
    s = snap([node(1)], [job(3), job(1), job(2, waited=61)])
    assert plan(s).order == [2, 1, 3]


# --- 2. eligible pools ------------------------------------------------------------------------


def test_gpu_type_must_match_unless_any():
    pools = {1: owned(1, "H100"), 2: owned(2, "H200")}
    s = snap(
        [node(1, pool=1), node(2, pool=2)],
        [job(1, gpu_type="H200"), job(2, gpu_type="A100"), job(3, gpu_type=ANY_GPU)],
        pools=pools,
    )
    d = plan(s)
    assert nodes_of(d, 1) == [2]
    assert nodes_of(d, 3) == [1]
    assert d.waits[2].reason == "no eligible pool can hold 1 node of 8 A100 among owned pools"


def test_placement_owned_cloud_and_owned_then_cloud():
    pools = {1: owned(1), 9: cloud(9)}
    nodes = [node(1, pool=1, rack=1), node(2, pool=9, rack=None), node(3, pool=9, rack=None)]
    s = snap(
        nodes,
        [job(1, placement=CLOUD), job(2, placement=OWNED_THEN_CLOUD), job(3, placement=OWNED)],
        pools=pools,
    )
    d = plan(s)
    by_job = {p.job_id: p.pool_id for p in d.placements}
    assert by_job == {1: 9, 2: 1}  # owned first for owned-then-cloud
    assert 3 in d.waits  # the owned node went to the higher job 2


def test_owned_then_cloud_spills_to_cloud_when_owned_is_full():
    pools = {1: owned(1), 9: cloud(9)}
    s = snap(
        [node(1, pool=1), node(2, pool=9, rack=None)],
        [job(1, placement=OWNED), job(2, placement=OWNED_THEN_CLOUD)],
        pools=pools,
    )
    assert {p.job_id: p.pool_id for p in plan(s).placements} == {1: 1, 2: 9}


def test_a_disabled_pool_takes_nothing():
    pools = {1: replace(owned(1), enabled=False)}
    d = plan(snap([node(1)], [job(1)], pools=pools))
    assert not d.placements
    assert d.waits[1].reason.startswith("no eligible pool can hold")


def test_no_eligible_pool_can_hold_a_gang_bigger_than_any_pool():
    d = plan(snap([node(1), node(2)], [job(1, nodes=16)]))
    assert d.waits[1].reason == "no eligible pool can hold 16 nodes of 8 H100 among owned pools"


# --- 3. gang placement ------------------------------------------------------------------------


def test_a_gang_goes_to_the_rack_it_fills_best():
    nodes = [node(i, rack=1) for i in (1, 2, 3)] + [node(i, rack=2) for i in (4, 5)]
    d = plan(snap(nodes, [job(1, nodes=2)]))
    assert nodes_of(d, 1) == [4, 5]


def test_a_gang_spans_racks_when_no_rack_holds_it_and_is_all_or_nothing():
    nodes = [node(i, rack=1) for i in (1, 2)] + [node(i, rack=2) for i in (3, 4, 5)]
    d = plan(snap(nodes, [job(1, nodes=4), job(2, nodes=3)]))
    got = nodes_of(d, 1)
    assert len(got) == 4 and {3, 4, 5} <= set(got)  # the fullest rack whole, then the rest
    assert 2 not in placed(d)  # one node is left: the 3-node gang takes nothing
    assert all(g == 8 for _, g in placed(d)[1])


def test_a_one_node_job_takes_the_node_with_the_fewest_free_gpus_that_fits():
    nodes = [node(1), node(2), node(3)]
    running = [run(10, [(2, 4)]), run(11, [(3, 6)])]  # free: 8, 4, 2
    d = plan(snap(nodes, [job(1, gpus=2), job(2, gpus=3)], running=running))
    assert placed(d)[1] == ((3, 2),)
    assert placed(d)[2] == ((2, 3),)


def test_the_tightest_pool_of_a_kind_wins_and_ties_go_to_the_lower_pool_id():
    pools = {1: owned(1), 2: owned(2)}
    nodes = [node(1, pool=1), node(2, pool=2)]
    running = [run(10, [(2, 6)], pool=2)]
    d = plan(snap(nodes, [job(1, gpus=2)], pools=pools, running=running))
    assert placed(d)[1] == ((2, 2),)
    d = plan(snap(nodes, [job(1, gpus=2)], pools=pools))
    assert placed(d)[1] == ((1, 2),)


def test_a_gpu_is_never_booked_twice_in_a_pass():
    d = plan(snap([node(1)], [job(1, gpus=4), job(2, gpus=4), job(3, gpus=1)]))
    assert set(placed(d)) == {1, 2}
    assert 3 in d.waits


def test_unschedulable_nodes_take_nothing():
    d = plan(snap([node(1, schedulable=False), node(2)], [job(1), job(2)]))
    assert nodes_of(d, 1) == [2]
    assert 2 in d.waits


# --- 4. quotas ----------------------------------------------------------------------------------


def test_a_team_at_its_quota_waits_and_says_so():
    running = [run(10, [(1, 8)], team=1)]
    d = plan(
        snap(
            [node(1), node(2)],
            [job(1, team=1)],
            running=running,
            quotas={(1, "H100"): Quota(nominal=8)},
        )
    )
    assert not d.placements
    assert d.waits[1].reason == "waiting for 8 H100: team quota 8/8 in use"


def test_borrowing_is_allowed_up_to_the_borrow_limit():
    quotas = {(1, "H100"): Quota(nominal=8, borrow=8)}
    nodes = [node(i) for i in (1, 2, 3, 4)]
    d = plan(snap(nodes, [job(1, nodes=2), job(2)], quotas=quotas))
    assert set(placed(d)) == {1}
    assert d.waits[2].reason == (
        "waiting for 8 H100: team quota 16/16 (8 nominal + 8 borrowable) in use"
    )


def test_quotas_count_this_pass_placements_and_are_per_gpu_type():
    pools = {1: owned(1, "H100"), 2: owned(2, "H200")}
    quotas = {(1, "H100"): Quota(nominal=8), (1, "H200"): Quota(nominal=8)}
    nodes = [node(1, pool=1), node(2, pool=1), node(3, pool=2)]
    pending = [job(1), job(2), job(3, gpu_type=ANY_GPU)]
    d = plan(snap(nodes, pending, pools=pools, quotas=quotas))
    assert set(placed(d)) == {1, 3}
    assert {p.job_id: p.pool_id for p in d.placements}[3] == 2  # H100 is used up
    assert "team quota 8/8" in d.waits[2].reason


def test_a_job_bigger_than_the_whole_quota_says_so():
    quotas = {(1, "H100"): Quota(nominal=8, borrow=4)}
    d = plan(snap([node(1), node(2)], [job(1, nodes=2)], quotas=quotas))
    assert d.waits[1].reason == (
        "waiting for 16 H100: more than the team's whole H100 quota of 12"
        " (8 nominal + 4 borrowable)"
    )


def test_no_quota_entry_means_no_limit():
    d = plan(snap([node(1), node(2)], [job(1, nodes=2)], quotas={(2, "H100"): Quota(nominal=0)}))
    assert set(placed(d)) == {1}


# --- 5. reservation windows -----------------------------------------------------------------------


def maintenance(nodes, start, end, team=None, window_id=1) -> Window:
    return Window(id=window_id, node_ids=frozenset(nodes), team_id=team, start=start, end=end)


def test_nothing_is_placed_that_would_still_run_when_maintenance_starts():
    window = maintenance([1], NOW + HOUR, NOW + 3 * HOUR)
    d = plan(snap([node(1)], [job(1, limit=2 * HOUR)], windows=(window,)))
    assert not d.placements
    assert d.waits[1].reason.startswith(
        "waiting for 8 H100: held back by a maintenance window on 1 node (13:00 UTC to 15:00 UTC)"
    )
    assert d.waits[1].estimated_start == NOW + 3 * HOUR
    d = plan(snap([node(1)], [job(1, limit=HOUR)], windows=(window,)))
    assert set(placed(d)) == {1}  # it ends as the window starts


def test_nothing_is_placed_during_maintenance():
    window = maintenance([1], NOW - HOUR, NOW + HOUR)
    d = plan(snap([node(1), node(2)], [job(1), job(2)], windows=(window,)))
    assert nodes_of(d, 1) == [2]
    assert 2 in d.waits


def test_a_team_window_takes_only_that_teams_jobs():
    window = maintenance([1], NOW - HOUR, NOW + 10 * HOUR, team=7)
    d = plan(snap([node(1)], [job(1, team=3), job(2, team=7)], windows=(window,)))
    assert set(placed(d)) == {2}
    assert "team 7's window" in d.waits[1].reason
    # Before the window starts, another team's job may run only if it ends in time.
    later = maintenance([1], NOW + 2 * HOUR, NOW + 10 * HOUR, team=7)
    d = plan(snap([node(1)], [job(1, team=3, limit=HOUR)], windows=(later,)))
    assert set(placed(d)) == {1}
    d = plan(snap([node(1)], [job(1, team=3, limit=3 * HOUR)], windows=(later,)))
    assert not d.placements


def test_a_gang_goes_around_a_window_node_in_its_rack():
    nodes = [node(i, rack=1) for i in (1, 2, 3)] + [node(i, rack=2) for i in (4, 5)]
    window = maintenance([4], NOW - HOUR, NOW + HOUR)
    d = plan(snap(nodes, [job(1, nodes=3), job(2, nodes=2)], windows=(window,)))
    assert nodes_of(d, 1) == [1, 2, 3]  # rack 2 has only one usable node left
    assert 2 in d.waits
    d = plan(snap(nodes, [job(1, nodes=4)], windows=(window,)))
    assert nodes_of(d, 1) == [1, 2, 3, 5]


def test_a_past_window_does_not_matter():
    window = maintenance([1], NOW - 3 * HOUR, NOW - HOUR)
    assert set(placed(plan(snap([node(1)], [job(1)], windows=(window,))))) == {1}


# --- 6. backfill ----------------------------------------------------------------------------------


def backfill_case(*pending, **kw):
    """Two nodes; node 1 is busy for an hour, node 2 is free."""
    nodes = [node(1), node(2)]
    running = [run(90, [(1, 8)], ends_in=HOUR)]
    kw.setdefault("settings", PlanSettings(preemption=False))
    return snap(nodes, pending, running=running, **kw)


def test_a_blocked_job_reserves_its_earliest_start_and_short_jobs_backfill():
    s = backfill_case(
        job(1, priority=2, nodes=2, limit=2 * HOUR),  # needs both nodes: blocked until 13:00
        job(2, limit=2 * HOUR),  # would still hold node 2 at 13:00: may not backfill
        job(3, limit=HOUR / 2),  # ends by 13:00: backfills
    )
    d = plan(s)
    assert d.waits[1].estimated_start == NOW + HOUR
    assert d.waits[1].reason == (
        "waiting for 2 × 8 H100 in one pool: 1 node free now; earliest start 13:00 UTC (reserved)"
    )
    assert [(p.job_id, p.backfilled) for p in d.placements] == [(3, True)]
    assert d.waits[2].reason.startswith("waiting for 8 H100: 1 node free now, held for higher")
    # The next blocked job queues behind the first reservation, not over it.
    assert d.waits[2].estimated_start == NOW + 3 * HOUR


def test_placements_before_any_blocked_job_are_not_backfilled():
    d = plan(backfill_case(job(1)))
    assert [(p.job_id, p.backfilled) for p in d.placements] == [(1, False)]


def test_a_shadow_in_one_pool_does_not_hold_back_another_pool():
    pools = {1: owned(1, "H100"), 2: owned(2, "H200")}
    nodes = [node(1, pool=1), node(2, pool=1), node(3, pool=2)]
    running = [run(90, [(1, 8)])]
    s = snap(
        nodes,
        [job(1, nodes=2, priority=2, limit=5 * HOUR), job(2, gpu_type="H200", limit=9 * HOUR)],
        pools=pools,
        running=running,
    )
    d = plan(s)
    assert [(p.job_id, p.backfilled) for p in d.placements] == [(2, False)]


def test_jobs_beyond_the_backfill_depth_get_a_generic_reason():
    s = backfill_case(
        job(1, priority=2, nodes=2),
        job(2, limit=5 * HOUR),
        job(3, limit=5 * HOUR),
        job(4, limit=60),
        settings=PlanSettings(backfill_depth=2, preemption=False),
    )
    d = plan(s)
    assert d.waits[4].reason == BEYOND_DEPTH
    assert d.waits[4].estimated_start is None
    assert not d.placements  # job 4 would have fitted, but the depth stops the search


def test_a_job_behind_a_full_fleet_gets_an_estimate_from_time_limits():
    running = [run(90, [(1, 8)], ends_in=2 * HOUR)]
    d = plan(snap([node(1)], [job(1)], running=running, settings=PlanSettings(preemption=False)))
    assert d.waits[1].estimated_start == NOW + 2 * HOUR
    assert d.waits[1].reason == (
        "waiting for 8 H100: no node has 8 free GPUs now; earliest start 14:00 UTC (reserved)"
    )


def test_clock_is_utc_and_names_the_day_when_not_today():
    assert clock(NOW + 8 * 60 + 5, NOW) == "12:08 UTC"
    assert clock(NOW + 13 * HOUR, NOW) == "2026-12-02 01:00 UTC"


# --- 7. preemption ------------------------------------------------------------------------------


def test_a_higher_class_job_preempts_the_fewest_lowest_youngest_jobs():
    nodes = [node(1), node(2)]
    running = [
        run(10, [(1, 4)], priority=0, ends_in=5 * HOUR),
        run(11, [(1, 4)], priority=0, ends_in=4 * HOUR),
        run(12, [(2, 8)], priority=1, ends_in=9 * HOUR),
    ]
    d = plan(snap(nodes, [job(1, priority=3)], running=running))
    assert not d.placements
    assert sorted(p.job_id for p in d.preemptions) == [10, 11]  # class 0 before class 1
    assert all(p.for_job_id == 1 for p in d.preemptions)
    assert d.preemptions[0].reason.startswith("preempted by a higher-priority job")
    assert d.waits[1].reason == "waiting for 2 preempted jobs to checkpoint and stop"


def test_the_free_part_of_a_preemption_is_held_for_the_job():
    running = [run(10, [(2, 8)], priority=0)]
    pending = [job(1, priority=3, nodes=2), job(2, priority=1, limit=60)]
    d = plan(snap([node(1), node(2)], pending, running=running))
    assert [p.job_id for p in d.preemptions] == [10]
    assert not d.placements  # node 1 is free, but job 1 will need it once job 10 stops
    assert "held for higher-priority jobs" in d.waits[2].reason


def test_preemption_takes_one_big_victim_over_two_small_ones():
    nodes = [node(1), node(2)]
    running = [
        run(10, [(1, 4)], priority=0, ends_in=5 * HOUR),  # the youngest: tried first
        run(11, [(2, 8)], priority=0, ends_in=4 * HOUR),
        run(12, [(1, 4)], priority=0, ends_in=3 * HOUR),
    ]
    d = plan(snap(nodes, [job(1, priority=2)], running=running))
    assert [p.job_id for p in d.preemptions] == [11]


def test_no_preemption_of_the_same_class_or_of_jobs_already_stopping():
    running = [run(10, [(1, 8)], priority=1), run(11, [(2, 8)], priority=0, preemptible=False)]
    d = plan(snap([node(1), node(2)], [job(1, priority=1)], running=running))
    assert not d.preemptions
    assert d.waits[1].estimated_start == NOW + HOUR


def test_no_preemption_for_a_job_that_fits_on_free_capacity():
    running = [run(10, [(1, 8)], priority=0)]
    d = plan(snap([node(1), node(2)], [job(1, priority=3)], running=running))
    assert not d.preemptions
    assert nodes_of(d, 1) == [2]


def test_a_running_job_is_preempted_at_most_once_a_pass():
    running = [run(10, [(1, 8)], priority=0)]
    d = plan(snap([node(1)], [job(1, priority=3), job(2, priority=3)], running=running))
    assert [(p.job_id, p.for_job_id) for p in d.preemptions] == [(10, 1)]
    assert "preempted" not in d.waits[2].reason


def test_preemption_can_be_switched_off():
    running = [run(10, [(1, 8)], priority=0)]
    s = snap(
        [node(1)], [job(1, priority=3)], running=running, settings=PlanSettings(preemption=False)
    )
    assert not plan(s).preemptions


def test_a_team_within_its_nominal_quota_reclaims_from_borrowers():
    quotas = {(1, "H100"): Quota(nominal=8), (2, "H100"): Quota(nominal=8, borrow=8)}
    running = [
        run(10, [(1, 8)], team=2, priority=3, ends_in=2 * HOUR),
        run(11, [(2, 8)], team=2, priority=3, ends_in=5 * HOUR),
    ]
    d = plan(snap([node(1), node(2)], [job(1, team=1, priority=0)], running=running, quotas=quotas))
    assert [(p.job_id, p.for_job_id) for p in d.preemptions] == [(11, 1)]  # the youngest
    assert "reclaims its nominal H100 quota" in d.preemptions[0].reason
    # Over its nominal, the same team cannot reclaim.
    quotas[(1, "H100")] = Quota(nominal=4, borrow=8)
    d = plan(snap([node(1), node(2)], [job(1, team=1, priority=0)], running=running, quotas=quotas))
    assert not d.preemptions


def test_a_team_that_goes_over_its_nominal_quota_in_this_pass_is_a_borrower_in_it():
    """Team 2 holds its nominal 8 when the pass starts, then is placed 8 more (a high job,
    walked first): its running job is a borrower for team 1's job later in the same pass."""
    quotas = {(1, "H100"): Quota(nominal=8), (2, "H100"): Quota(nominal=8, borrow=8)}
    running = [run(10, [(1, 8)], team=2, priority=1)]
    pending = [job(1, team=1, priority=1), job(2, team=2, priority=2)]
    d = plan(snap([node(1), node(2)], pending, running=running, quotas=quotas))
    assert [p.job_id for p in d.placements] == [2]
    assert [(p.job_id, p.for_job_id) for p in d.preemptions] == [(10, 1)]
    assert "reclaims its nominal H100 quota" in d.preemptions[0].reason


# --- 8. burst -------------------------------------------------------------------------------------


def burst_case(*pending, **pool_kw):
    pools = {1: owned(1), 9: cloud(9, **pool_kw)}
    running = [run(10, [(1, 8)], priority=3)]
    return snap([node(1, pool=1)], pending, pools=pools, running=running)


def test_a_job_that_waited_past_the_burst_delay_asks_for_cloud_nodes():
    d = plan(burst_case(job(1, nodes=2, placement=OWNED_THEN_CLOUD, waited=900, spot=True)))
    assert [(b.job_id, b.pool_id, b.nodes, b.spot) for b in d.bursts] == [(1, 9, 2, True)]
    assert d.waits[1].reason == "waiting for 2 × 8 H100: 2 nodes requested from cloud pool 9 (spot)"


def test_spot_only_when_both_pool_and_job_allow_it():
    d = plan(burst_case(job(1, placement=CLOUD, waited=900, spot=False)))
    assert [b.spot for b in d.bursts] == [False]
    d = plan(burst_case(job(1, placement=CLOUD, waited=900, spot=True), spot=False))
    assert [b.spot for b in d.bursts] == [False]


def test_no_burst_before_the_delay_for_owned_only_or_past_max_nodes():
    d = plan(burst_case(job(1, placement=OWNED_THEN_CLOUD, waited=60)))
    assert not d.bursts
    assert "; cloud burst from 12:09 UTC" in d.waits[1].reason
    assert not plan(burst_case(job(1, placement=OWNED, waited=900))).bursts
    assert not plan(burst_case(job(1, nodes=5, placement=CLOUD, waited=900))).bursts
    big = job(1, gpus=8, placement=CLOUD, waited=900)
    assert not plan(burst_case(big, gpus_per_node=4)).bursts


def test_max_nodes_counts_this_pass_bursts_and_one_burst_per_job():
    d = plan(
        burst_case(
            job(1, nodes=3, placement=CLOUD, waited=900),
            job(2, nodes=2, placement=CLOUD, waited=900),
            job(3, nodes=1, placement=CLOUD, waited=900),
        )
    )
    assert [(b.job_id, b.nodes) for b in d.bursts] == [(1, 3), (3, 1)]


def test_no_budget_no_burst():
    d = plan(burst_case(job(1, placement=CLOUD, waited=900, budget_ok=False)))
    assert not d.bursts
    assert d.waits[1].reason == "budget exhausted: 8 H100 could only run on new cloud nodes"
    d = plan(burst_case(job(1, placement=OWNED_THEN_CLOUD, waited=900, budget_ok=False)))
    assert not d.bursts
    assert d.waits[1].reason.endswith(
        "no cloud burst: budget exhausted; earliest start 13:00 UTC (reserved)"
    )


# --- 9. reasons -----------------------------------------------------------------------------------


def test_every_waiting_job_has_a_reason_and_placed_ones_have_none():
    running = [run(10, [(1, 8)])]
    d = plan(snap([node(1), node(2)], [job(1), job(2), job(3, nodes=3)], running=running))
    assert set(placed(d)) == {1}
    assert set(d.waits) == {2, 3}
    assert all(w.reason for w in d.waits.values())


# --- 10. one team per node ------------------------------------------------------------------------


def own(node_id, **kw) -> NodeSlot:
    """A node that holds one team's jobs at a time (not shared: the default in NodeSlot)."""
    return node(node_id, shared=False, **kw)


def test_teams_share_a_shared_node_and_not_one_that_is_not():
    pending = [job(1, team=1, gpus=2), job(2, team=2, gpus=2)]
    running = [run(10, [(1, 4)], team=1)]
    d = plan(snap([node(1), node(2)], pending, running=running))
    assert nodes_of(d, 1) == [1] and nodes_of(d, 2) == [1]  # packed, as before
    d = plan(snap([own(1), own(2)], pending, running=running))
    assert nodes_of(d, 1) == [1]  # its team's own node
    assert nodes_of(d, 2) == [2]


def test_a_one_node_job_takes_the_tightest_of_its_teams_own_nodes_first():
    nodes = [own(1), own(2), own(3), own(4)]
    running = [run(10, [(1, 2)], team=1), run(11, [(2, 5)], team=1), run(12, [(3, 7)], team=2)]
    # Free: node 1 6 (team 1's), node 2 3 (team 1's), node 3 1 (team 2's), node 4 8 (nobody's).
    d = plan(
        snap(
            nodes,
            [job(1, team=1, gpus=2), job(2, team=1, gpus=4), job(3, team=3, gpus=1)],
            running=running,
        )
    )
    assert nodes_of(d, 1) == [2]
    assert nodes_of(d, 2) == [1]
    assert nodes_of(d, 3) == [4]  # not team 2's node 3, though it is the tightest
    # Team 3 owns node 4 now: a later job of team 4 finds nowhere to go.
    d = plan(
        snap(nodes, [job(3, team=3, gpus=1), job(4, team=4, gpus=1, priority=0)], running=running)
    )
    assert nodes_of(d, 3) == [4] and 4 not in placed(d)


def test_a_teams_own_node_keeps_reservations_and_windows():
    running = [run(10, [(1, 4)], team=1, ends_in=HOUR)]
    window = maintenance([1], NOW + HOUR, NOW + 2 * HOUR)
    s = snap([own(1)], [job(1, team=1, gpus=4, limit=2 * HOUR)], running=running, windows=(window,))
    d = plan(s)
    assert not d.placements
    assert "held back by a maintenance window on 1 node" in d.waits[1].reason
    s = snap([own(1)], [job(1, team=1, gpus=4, limit=HOUR)], running=running, windows=(window,))
    assert nodes_of(plan(s), 1) == [1]  # it ends as the window starts
    # A higher job of another team reserved the node for when team 1's job ends: a job of
    # team 1 may still use its node now only if it ends by then.
    pending = [job(1, team=2, priority=2, gpus=8), job(2, team=1, gpus=4, limit=2 * HOUR)]
    d = plan(snap([own(1)], pending, running=running, settings=PlanSettings(preemption=False)))
    assert d.waits[1].estimated_start == NOW + HOUR
    assert not d.placements
    pending[1] = job(2, team=1, gpus=4, limit=HOUR / 2)
    d = plan(snap([own(1)], pending, running=running, settings=PlanSettings(preemption=False)))
    assert [(p.job_id, p.backfilled) for p in d.placements] == [(2, True)]
    assert d.waits[1].estimated_start == NOW + HOUR


def test_a_gang_takes_only_nodes_no_team_holds():
    nodes = [own(1), own(2), own(3), own(4)]
    running = [run(10, [(1, 4)], team=1), run(11, [(2, 4)], team=1)]
    pending = [job(1, team=1, nodes=2, gpus=4)]
    d = plan(snap(nodes, pending, running=running))
    assert nodes_of(d, 1) == [3, 4]  # not its own team's nodes 1 and 2, though they fit
    d = plan(snap(nodes[:2], pending, running=running, settings=PlanSettings(preemption=False)))
    assert d.waits[1].reason == (
        "waiting for 2 × 4 H100 in one pool: no node free now (2 nodes with room hold a "
        "team's jobs: one team per node, and a gang waits for empty ones); earliest start "
        "13:00 UTC (reserved)"
    )


def test_a_node_that_holds_two_teams_jobs_takes_nothing_until_they_end():
    running = [run(10, [(1, 2)], team=1, ends_in=HOUR), run(11, [(1, 2)], team=2, ends_in=2 * HOUR)]
    pending = [job(1, team=1, gpus=2), job(2, team=2, gpus=2), job(3, team=3, gpus=2)]
    d = plan(snap([own(1)], pending, running=running, settings=PlanSettings(preemption=False)))
    assert not d.placements
    assert d.waits[1].reason == (
        "waiting for 2 H100: no node has 2 free GPUs now (1 node with room holds other "
        "teams' jobs: one team per node); earliest start 14:00 UTC (reserved)"
    )
    assert d.waits[1].estimated_start == NOW + 2 * HOUR  # when both have ended


def test_the_reason_names_the_nodes_other_teams_hold():
    nodes = [own(i) for i in (1, 2, 3, 4)]
    running = [run(10 + i, [(i, 4)], team=1, ends_in=i * HOUR) for i in (1, 2, 3)]
    running.append(run(14, [(4, 8)], team=2, ends_in=HOUR))
    d = plan(
        snap(
            nodes,
            [job(1, team=2, gpus=4)],
            running=running,
            settings=PlanSettings(preemption=False),
        )
    )
    assert d.waits[1].reason == (
        "waiting for 4 H100: no node has 4 free GPUs now (3 nodes with room hold other teams' "
        "jobs: one team per node); earliest start 13:00 UTC (reserved)"
    )
    # Team 1's own nodes with room are not "other teams'" for its own job.
    d = plan(
        snap(
            nodes,
            [job(1, team=1, gpus=6)],
            running=running,
            settings=PlanSettings(preemption=False),
        )
    )
    assert d.waits[1].reason.startswith("waiting for 6 H100: no node has 6 free GPUs now;")


def test_preemption_frees_a_node_only_when_every_job_on_it_stops():
    """Job 10 (team 2) shares node 1 with job 11 (team 3, urgent: no victim); job 12 (team
    4) holds node 2 alone. Job 10 is the youngest, so tried first."""
    running = [
        run(10, [(1, 4)], team=2, priority=0, ends_in=5 * HOUR),
        run(11, [(1, 4)], team=3, priority=3, ends_in=4 * HOUR),
        run(12, [(2, 8)], team=4, priority=0, ends_in=3 * HOUR),
    ]
    pending = [job(1, team=1, priority=3, gpus=4)]
    d = plan(snap([node(1), node(2)], pending, running=running))
    assert [p.job_id for p in d.preemptions] == [10]  # shared: job 10's GPUs are enough
    d = plan(snap([own(1), own(2)], pending, running=running))
    assert [p.job_id for p in d.preemptions] == [12]  # node 1 would still hold team 3's job
    assert d.waits[1].reason == "waiting for 1 preempted job to checkpoint and stop"
    # Reserved for it: nothing else goes on node 2 in this pass.
    d = plan(snap([own(1), own(2)], [*pending, job(2, team=4, gpus=4)], running=running))
    assert 2 not in placed(d)


def test_preemption_on_a_teams_own_node_counts_its_spare_gpus():
    # Node 1 is team 1's, with 4 GPUs free; job 11 is urgent, so no victim.
    running = [run(10, [(1, 2)], team=1, priority=0), run(11, [(1, 2)], team=1, priority=3)]
    d = plan(snap([own(1)], [job(1, team=1, priority=3, gpus=6)], running=running))
    assert [p.job_id for p in d.preemptions] == [10]  # its 2 GPUs and the node's 4 spare
    d = plan(snap([own(1)], [job(1, team=3, priority=3, gpus=6)], running=running))
    assert not d.preemptions  # another team's job would need every job on it to stop
    d = plan(snap([node(1)], [job(1, team=3, priority=3, gpus=6)], running=running))
    assert [p.job_id for p in d.preemptions] == [10]  # shared


def test_a_gang_preempts_only_for_whole_nodes():
    running = [run(10, [(1, 4)], team=1, priority=0), run(11, [(2, 4)], team=1, priority=0)]
    d = plan(snap([own(1), own(2)], [job(1, team=1, priority=3, nodes=2, gpus=4)], running=running))
    assert sorted(p.job_id for p in d.preemptions) == [10, 11]


# --- 10. node ranges (min_nodes) -------------------------------------------------------------


def four_nodes_two_busy(*pending, **kw):
    """Four nodes in one rack; nodes 1 and 2 are held by another team for an hour."""
    running = [run(90, [(1, 8)]), run(91, [(2, 8)])]
    kw.setdefault("settings", PlanSettings(preemption=False))
    return snap([node(i) for i in (1, 2, 3, 4)], pending, running=running, **kw)


def test_a_job_with_a_node_range_gets_its_whole_gang_when_it_fits():
    d = plan(snap([node(i) for i in (1, 2, 3, 4)], [job(1, nodes=3, min_nodes=1)]))
    assert nodes_of(d, 1) == [1, 2, 3]


def test_a_job_with_a_node_range_gets_the_nodes_that_fit_when_its_gang_does_not():
    d = plan(four_nodes_two_busy(job(1, nodes=4, min_nodes=1)))
    assert nodes_of(d, 1) == [3, 4]
    assert all(gpus == 8 for _, gpus in placed(d)[1])
    assert 1 not in d.waits


def test_a_job_with_a_node_range_never_starts_below_min_nodes():
    d = plan(four_nodes_two_busy(job(1, nodes=4, min_nodes=3)))
    assert not d.placements
    # It waits, and reserves, for its whole gang.
    assert d.waits[1].reason.startswith("waiting for 4 × 8 H100 in one pool: 2 nodes free now")
    assert d.waits[1].estimated_start == NOW + HOUR


def test_a_job_without_a_range_is_all_or_nothing_as_before():
    d = plan(four_nodes_two_busy(job(1, nodes=4), job(2, nodes=4, min_nodes=4)))
    assert not d.placements
    assert d.waits[1].estimated_start == NOW + HOUR


def test_a_job_with_a_range_goes_first_only_where_its_place_in_the_queue_says():
    """A higher job that fits whole takes its nodes first; the ranged job gets what is left."""
    d = plan(four_nodes_two_busy(job(1, nodes=1, priority=2), job(2, nodes=4, min_nodes=1)))
    assert len(placed(d)[1]) == 1
    assert len(placed(d)[2]) == 1


def test_fewer_nodes_keep_clear_of_a_higher_jobs_reservation():
    """Job 1 (higher) waits for all four nodes at 13:00 and holds nodes 3 and 4 from then:
    the ranged job may take them now only if it ends by 13:00, else it waits."""
    long = four_nodes_two_busy(
        job(1, nodes=4, priority=2), job(2, nodes=2, min_nodes=1, limit=2 * HOUR)
    )
    d = plan(long)
    assert 2 not in placed(d)
    short = four_nodes_two_busy(
        job(1, nodes=4, priority=2), job(2, nodes=3, min_nodes=1, limit=HOUR / 2)
    )
    d = plan(short)
    assert nodes_of(d, 2) == [3, 4] and placed(d)[2] and d.placements[0].backfilled


def test_a_job_with_a_range_takes_what_its_quota_has_room_for_and_quotas_count_it():
    quotas = {(1, "H100"): Quota(nominal=16)}
    pending = [job(1, nodes=3, min_nodes=1), job(2, nodes=1)]
    d = plan(snap([node(i) for i in (1, 2, 3, 4)], pending, quotas=quotas))
    assert len(placed(d)[1]) == 2  # 16 of its 24 GPUs: all the quota has room for
    assert d.waits[2].reason == "waiting for 8 H100: team quota 16/16 in use"


def test_a_job_whose_min_nodes_exceed_the_quota_waits_for_its_whole_gang():
    quotas = {(1, "H100"): Quota(nominal=8)}
    d = plan(snap([node(i) for i in (1, 2, 3)], [job(1, nodes=3, min_nodes=2)], quotas=quotas))
    assert not d.placements
    assert d.waits[1].reason == "waiting for 24 H100: more than the team's whole H100 quota of 8"


def test_a_job_with_a_range_bigger_than_any_pool_runs_on_what_a_pool_can_hold():
    d = plan(snap([node(1), node(2)], [job(1, nodes=3, min_nodes=2), job(2, nodes=3)]))
    assert nodes_of(d, 1) == [1, 2]
    assert d.waits[2].reason.startswith("no eligible pool can hold 3 nodes")


def test_a_one_node_floor_may_use_the_teams_own_node():
    """Node 1 is not shared and holds a job of team 1 with 4 GPUs to spare; the free node 2
    is taken by a higher job first. Only the team's own node is left: a range down to one
    node takes it, as a one-node job would."""
    nodes = [node(1, total=8, shared=False), node(2, shared=False)]
    running = [run(90, [(1, 4)], team=1)]
    pending = [job(1, team=2, priority=2), job(2, team=1, nodes=2, gpus=4, min_nodes=1)]
    d = plan(snap(nodes, pending, running=running, settings=PlanSettings(preemption=False)))
    assert nodes_of(d, 1) == [2]
    assert placed(d)[2] == ((1, 4),)


# --- invariants, on random small fleets ------------------------------------------------------

GPU_TYPES = ("H100", "H200")
TEAMS = (1, 2, 3)


@st.composite
def snapshots(draw) -> Snapshot:
    pools = {}
    for pool_id in range(1, draw(st.integers(1, 3)) + 1):
        kind = draw(st.sampled_from(("owned", "owned", "cloud")))
        pools[pool_id] = PoolInfo(
            id=pool_id,
            kind=kind,
            gpu_type=draw(st.sampled_from(GPU_TYPES)),
            spot=draw(st.booleans()),
            enabled=draw(st.integers(0, 5)) > 0,
            burst_delay_s=draw(st.sampled_from((0, 600))),
            max_nodes=draw(st.integers(0, 8)),
            gpus_per_node=draw(st.sampled_from((4, 8))),
        )
    nodes = []
    for pool_id in pools:
        for _ in range(draw(st.integers(0 if pool_id > 1 else 1, 6))):
            nodes.append(
                NodeSlot(
                    id=len(nodes) + 1,
                    pool_id=pool_id,
                    rack_id=draw(st.sampled_from((pool_id * 10, pool_id * 10 + 1, None))),
                    gpus_total=draw(st.sampled_from((4, 8, 8))),
                    gpus_free=0,
                    schedulable=draw(st.integers(0, 6)) > 0,
                    shared=draw(st.booleans()),
                    degraded=draw(st.integers(0, 3)) == 0,
                )
            )
    free = {n.id: n.gpus_total for n in nodes}
    running = []
    for job_id in range(1000, 1000 + draw(st.integers(0, 8))):
        if not nodes:
            break
        pool_id = draw(st.sampled_from(sorted({n.pool_id for n in nodes})))
        mine = [n.id for n in nodes if n.pool_id == pool_id and free[n.id] > 0]
        if not mine:
            continue
        chosen = draw(st.lists(st.sampled_from(mine), min_size=1, max_size=2, unique=True))
        node_gpus = []
        for node_id in chosen:
            # Often the whole node: full fleets are where backfill and preemption happen.
            gpus = draw(st.one_of(st.just(free[node_id]), st.integers(1, free[node_id])))
            free[node_id] -= gpus
            node_gpus.append((node_id, gpus))
        running.append(
            Running(
                job_id=job_id,
                team_id=draw(st.sampled_from(TEAMS)),
                gpu_type=pools[pool_id].gpu_type,
                priority=draw(st.integers(0, 3)),
                pool_id=pool_id,
                node_gpus=tuple(node_gpus),
                expected_end=NOW + draw(st.integers(-600, 20000)),
                preemptible=draw(st.integers(0, 4)) > 0,
            )
        )
    nodes = [n._replace(gpus_free=free[n.id]) for n in nodes]
    pending = []
    for job_id in range(1, draw(st.integers(0, 10)) + 1):
        gang = draw(st.integers(1, 3))
        pending.append(
            Pending(
                job_id=job_id,
                team_id=draw(st.sampled_from(TEAMS)),
                priority=draw(st.integers(0, 3)),
                queued_at=NOW - draw(st.integers(0, 2000)),
                gpu_type=draw(st.sampled_from((*GPU_TYPES, ANY_GPU))),
                nodes=gang,
                gpus_per_node=draw(st.sampled_from((1, 2, 4, 8))),
                placement=draw(st.sampled_from((OWNED, OWNED_THEN_CLOUD, CLOUD))),
                spot_allowed=draw(st.booleans()),
                time_limit_s=draw(st.sampled_from((600, 3600, 7200, 20000))),
                budget_ok=draw(st.integers(0, 4)) > 0,
                # A node range on about a third of the jobs (0: none).
                min_nodes=draw(st.sampled_from((0, 0, draw(st.integers(1, gang))))),
            )
        )
    quotas = {}
    for team in TEAMS:
        for gpu_type in GPU_TYPES:
            if draw(st.booleans()):
                quotas[(team, gpu_type)] = Quota(
                    nominal=draw(st.integers(0, 24)), borrow=draw(st.integers(0, 16))
                )
    windows = []
    for window_id in range(1, draw(st.integers(0, 2)) + 1):
        if not nodes:
            break
        start = NOW + draw(st.integers(-5000, 10000))
        windows.append(
            Window(
                id=window_id,
                node_ids=frozenset(
                    draw(st.lists(st.sampled_from([n.id for n in nodes]), max_size=4))
                ),
                team_id=draw(st.sampled_from((None, *TEAMS))),
                start=start,
                end=start + draw(st.integers(1, 10000)),
            )
        )
    return Snapshot(
        now=NOW,
        nodes=tuple(nodes),
        pools=pools,
        running=tuple(running),
        pending=tuple(pending),
        quotas=quotas,
        usage={team: float(draw(st.integers(0, 1000))) for team in TEAMS},
        shares={team: float(draw(st.integers(1, 3))) for team in TEAMS},
        windows=tuple(windows),
        settings=PlanSettings(
            backfill_depth=draw(st.sampled_from((0, 1, 3, 100))), preemption=draw(st.booleans())
        ),
    )


def eligible_pools(s: Snapshot, j: Pending) -> list[PoolInfo]:
    kinds = {OWNED: ("owned",), CLOUD: ("cloud",), OWNED_THEN_CLOUD: ("owned", "cloud")}
    return [
        p
        for p in s.pools.values()
        if p.enabled
        and p.kind in kinds[j.placement]
        and (j.gpu_type == ANY_GPU or p.gpu_type == j.gpu_type)
    ]


def blocks(w: Window, j: Pending, start: float) -> bool:
    end = start + j.time_limit_s
    return (w.team_id is None or w.team_id != j.team_id) and start < w.end and end > w.start


def teams_on(s: Snapshot, d=None, moment: float | None = None) -> dict[int, set[int]]:
    """node -> the teams of the jobs on it: the running ones (and the pass's placements,
    given its decisions), those still running at `moment` if given."""
    out: dict[int, set[int]] = {}
    for r in s.running:
        if moment is None or max(r.expected_end, s.now) > moment:
            for node_id, _ in r.node_gpus:
                out.setdefault(node_id, set()).add(r.team_id)
    jobs = {j.job_id: j for j in s.pending}
    for p in d.placements if d is not None else ():
        j = jobs[p.job_id]
        if moment is None or s.now + j.time_limit_s > moment:
            for node_id, _ in p.node_gpus:
                out.setdefault(node_id, set()).add(j.team_id)
    return out


def tenancy_allows(n: NodeSlot, j: Pending, teams: set[int]) -> bool:
    """Whether job j may go on node n, which holds jobs of `teams`: a shared node, a node
    that holds nothing, or (one-node jobs) a node that holds only j's team's jobs."""
    return n.shared or not teams or (j.nodes == 1 and teams == {j.team_id})


@given(snapshots())
def test_no_gpu_is_booked_twice_and_only_schedulable_nodes_are_booked(s):
    d = plan(s)
    nodes = {n.id: n for n in s.nodes}
    booked: dict[int, int] = {}
    for p in d.placements:
        for node_id, gpus in p.node_gpus:
            assert nodes[node_id].schedulable
            booked[node_id] = booked.get(node_id, 0) + gpus
    held: dict[int, int] = {}
    for r in s.running:
        for node_id, gpus in r.node_gpus:
            held[node_id] = held.get(node_id, 0) + gpus
    for node_id, gpus in booked.items():
        assert gpus + held.get(node_id, 0) <= nodes[node_id].gpus_total
        assert gpus <= nodes[node_id].gpus_free


@given(snapshots())
def test_a_node_that_is_not_shared_never_gets_a_second_team(s):
    """After a pass, no node that is not shared holds jobs of two teams (running and placed),
    unless it held them before the pass; then it is given nothing. Most nodes not shared."""
    s = replace(s, nodes=tuple(n._replace(shared=n.shared and n.id % 3 == 0) for n in s.nodes))
    d = plan(s)
    nodes = {n.id: n for n in s.nodes}
    before = teams_on(s)
    after = teams_on(s, d)
    for node_id, teams in after.items():
        if nodes[node_id].shared:
            continue
        if len(before.get(node_id, ())) > 1:
            assert teams == before[node_id]
            assert all(x != node_id for p in d.placements for x, _ in p.node_gpus)
        else:
            assert len(teams) == 1, (node_id, teams)


@given(snapshots())
def test_a_one_node_job_on_a_shared_node_takes_the_tightest_that_fits(s):
    """Shared nodes pack as before: replaying the placements, a one-node job placed on a
    shared node before any job blocked its pool (so no reservation) takes a node with the
    fewest free GPUs among those of the pool that any team may use (shared, or holding
    nothing) and where no window is in the way."""
    nodes = {n.id: n for n in s.nodes}
    for p, j, free, teams in replay(s, plan(s)):
        ((x, g),) = p.node_gpus if len(p.node_gpus) == 1 else ((None, 0),)
        if x is not None and nodes[x].shared and not p.backfilled:
            fits = [
                y
                for y, f in free.items()
                if nodes[y].pool_id == p.pool_id
                and f >= g
                and (nodes[y].shared or not teams.get(y))
                and not any(y in w.node_ids and blocks(w, j, s.now) for w in s.windows)
            ]
            assert free[x] == min(free[y] for y in fits)


def replay(s: Snapshot, d):
    """The pass's placements in order, each with its job, each schedulable node's free GPUs
    just before it and each node's teams (both updated once the next is asked for)."""
    jobs = {j.job_id: j for j in s.pending}
    free = {n.id: n.gpus_free for n in s.nodes if n.schedulable}
    teams = teams_on(s)
    for p in d.placements:
        j = jobs[p.job_id]
        yield p, j, free, teams
        for y, gpus in p.node_gpus:
            free[y] -= gpus
            teams.setdefault(y, set()).add(j.team_id)


def fewest(j: Pending) -> int:
    """The fewest nodes a job may start on: min_nodes, or all of them without a range."""
    return j.min_nodes or j.nodes


@given(snapshots())
def test_gangs_are_whole_on_distinct_nodes_of_one_eligible_pool(s):
    """Whole: all of a job's nodes, or, for a job with a node range, min_nodes to nodes."""
    d = plan(s)
    jobs = {j.job_id: j for j in s.pending}
    nodes = {n.id: n for n in s.nodes}
    for p in d.placements:
        j = jobs[p.job_id]
        ids = [node_id for node_id, _ in p.node_gpus]
        assert fewest(j) <= len(ids) <= j.nodes
        assert len(ids) == len(set(ids))
        assert all(gpus == j.gpus_per_node for _, gpus in p.node_gpus)
        assert {nodes[i].pool_id for i in ids} == {p.pool_id}
        assert p.pool_id in {pool.id for pool in eligible_pools(s, j)}


@given(snapshots())
def test_no_team_goes_above_nominal_plus_borrowing(s):
    d = plan(s)
    jobs = {j.job_id: j for j in s.pending}
    held: dict[tuple[int, str], int] = {}
    for r in s.running:
        held[(r.team_id, r.gpu_type)] = held.get((r.team_id, r.gpu_type), 0) + r.gpus
    grown = set()
    for p in d.placements:
        key = (jobs[p.job_id].team_id, s.pools[p.pool_id].gpu_type)
        held[key] = held.get(key, 0) + sum(gpus for _, gpus in p.node_gpus)
        grown.add(key)
    for key in grown:
        if key in s.quotas:
            assert held[key] <= s.quotas[key].limit


@given(snapshots())
def test_nothing_is_placed_across_a_window_it_may_not_use(s):
    d = plan(s)
    jobs = {j.job_id: j for j in s.pending}
    for p in d.placements:
        for node_id, _ in p.node_gpus:
            for w in s.windows:
                if node_id in w.node_ids:
                    assert not blocks(w, jobs[p.job_id], s.now)


def free_at(s: Snapshot, d, moment: float) -> dict[int, int]:
    """Each schedulable node's free GPUs at `moment`, given the running jobs and placements."""
    jobs = {j.job_id: j for j in s.pending}
    free = {n.id: n.gpus_free for n in s.nodes if n.schedulable}
    for r in s.running:
        if max(r.expected_end, s.now) <= moment:
            for node_id, gpus in r.node_gpus:
                if node_id in free:
                    free[node_id] += gpus
    for p in d.placements:
        if s.now + jobs[p.job_id].time_limit_s > moment:
            for node_id, gpus in p.node_gpus:
                free[node_id] -= gpus
    return free


@given(snapshots())
def test_backfilled_jobs_never_delay_a_reserved_start(s):
    """Every blocked job given an estimated start can still start then, in some eligible
    pool, on top of everything placed this pass (backfilled jobs included). A job with a
    node range reserves for the widest gang its quota and pools allow: at least min_nodes."""
    d = plan(s)
    nodes = {n.id: n for n in s.nodes}
    jobs = {j.job_id: j for j in s.pending}
    for job_id, w in d.waits.items():
        if w.estimated_start is None:
            continue
        j = jobs[job_id]
        free = free_at(s, d, w.estimated_start)
        teams = teams_on(s, d, w.estimated_start)
        assert any(
            sum(
                1
                for node_id, f in free.items()
                if nodes[node_id].pool_id == pool.id
                and f >= j.gpus_per_node
                and tenancy_allows(nodes[node_id], j, teams.get(node_id, set()))
                and not any(
                    node_id in win.node_ids and blocks(win, j, w.estimated_start)
                    for win in s.windows
                )
            )
            >= fewest(j)
            for pool in eligible_pools(s, j)
        ), (job_id, w)


@given(snapshots())
def test_removing_a_backfilled_job_never_brings_a_higher_start_forward(s):
    d = plan(s)
    backfilled = [p.job_id for p in d.placements if p.backfilled]
    if not backfilled:
        return
    without = replace(s, pending=tuple(j for j in s.pending if j.job_id != backfilled[0]))
    again = plan(without)
    position = d.order.index(backfilled[0])
    for job_id in d.order[:position]:
        before, after = d.waits.get(job_id), again.waits.get(job_id)
        if before is None or before.estimated_start is None or after is None:
            continue
        if after.estimated_start is not None and d.order[:position] == again.order[:position]:
            assert after.estimated_start >= before.estimated_start


@given(snapshots())
def test_the_first_job_is_placed_whenever_it_fits_now(s):
    """Work-conserving at the head of the queue: if quota allows and some eligible pool
    has enough usable nodes, the highest job is placed."""
    d = plan(s)
    if not d.order:
        return
    j = next(p for p in s.pending if p.job_id == d.order[0])
    teams = teams_on(s)
    for pool in eligible_pools(s, j):
        quota = s.quotas.get((j.team_id, pool.gpu_type))
        held = sum(
            r.gpus for r in s.running if (r.team_id, r.gpu_type) == (j.team_id, pool.gpu_type)
        )
        if quota is not None and held + j.gpus > quota.limit:
            continue
        usable = [
            n
            for n in s.nodes
            if n.pool_id == pool.id
            and n.schedulable
            and n.gpus_free >= j.gpus_per_node
            and tenancy_allows(n, j, teams.get(n.id, set()))
            and not any(n.id in w.node_ids and blocks(w, j, s.now) for w in s.windows)
        ]
        if len(usable) >= j.nodes:
            assert len(placed(d)[j.job_id]) == j.nodes  # a node range's whole gang first


@given(snapshots())
def test_the_first_job_with_a_node_range_starts_whenever_its_min_nodes_fit_now(s):
    """If quota allows min_nodes and some eligible pool has that many usable nodes (as a
    gang sees them), the highest job starts, on at least as many nodes as the best such
    pool and its quota offer."""
    s = replace(s, pending=tuple(j._replace(min_nodes=j.min_nodes or 1) for j in s.pending))
    d = plan(s)
    if not d.order:
        return
    j = next(p for p in s.pending if p.job_id == d.order[0])
    teams = teams_on(s)
    offered = 0
    for pool in eligible_pools(s, j):
        quota = s.quotas.get((j.team_id, pool.gpu_type))
        held = sum(
            r.gpus for r in s.running if (r.team_id, r.gpu_type) == (j.team_id, pool.gpu_type)
        )
        room = j.nodes if quota is None else (quota.limit - held) // j.gpus_per_node
        usable = [
            n
            for n in s.nodes
            if n.pool_id == pool.id
            and n.schedulable
            and n.gpus_free >= j.gpus_per_node
            and (n.shared or not teams.get(n.id))
            and not any(n.id in w.node_ids and blocks(w, j, s.now) for w in s.windows)
        ]
        offered = max(offered, min(len(usable), room, j.nodes))
    if offered >= j.min_nodes:
        assert len(placed(d)[j.job_id]) >= offered


@given(snapshots())
def test_every_pending_job_is_placed_or_told_why_it_waits(s):
    d = plan(s)
    placed_ids = [p.job_id for p in d.placements]
    assert len(placed_ids) == len(set(placed_ids))
    assert set(placed_ids).isdisjoint(d.waits)
    assert set(placed_ids) | set(d.waits) == {j.job_id for j in s.pending}
    assert all(w.reason for w in d.waits.values())


@given(snapshots())
def test_preemption_victims_are_running_preemptible_and_lower_or_borrowing(s):
    d = plan(s)
    running = {r.job_id: r for r in s.running}
    jobs = {j.job_id: j for j in s.pending}
    held: dict[tuple[int, str], int] = {}
    for r in s.running:
        held[(r.team_id, r.gpu_type)] = held.get((r.team_id, r.gpu_type), 0) + r.gpus
    victims = [p.job_id for p in d.preemptions]
    assert len(victims) == len(set(victims))
    if not s.settings.preemption:
        assert not victims
    for p in d.preemptions:
        victim, for_job = running[p.job_id], jobs[p.for_job_id]
        assert victim.preemptible
        assert p.for_job_id not in placed(d)
        quota = s.quotas.get((victim.team_id, victim.gpu_type))
        borrowing = quota is not None and held[(victim.team_id, victim.gpu_type)] > quota.nominal
        assert victim.priority < for_job.priority or (
            borrowing and victim.team_id != for_job.team_id
        )


def _borrowers_walking_everyone(self, job, pool):
    """borrowers() as first written: every running job of the pool, each team's quota
    looked up, with no list of the teams over their nominal quota to skip the rest."""
    taken: dict[tuple[int, str], int] = {}
    for r in pool.victim_order:
        if r.team_id == job.team_id or not r.preemptible or r.job_id in self.victims:
            continue
        key = (r.team_id, r.gpu_type)
        q = self.quotas.get(key)
        if q is not None and self.held.get(key, 0) - taken.get(key, 0) > q.nominal:
            taken[key] = taken.get(key, 0) + r.gpus
            yield r


@given(snapshots())
def test_borrowers_found_through_the_teams_over_quota_are_those_a_full_walk_finds(s):
    """The planner keeps the teams over their nominal quota as it goes (over_nominal) and
    looks for borrowers only among their jobs: every decision is the full walk's."""
    from apps.jobs.scheduler import plan as planner

    fast = plan(s)
    kept = planner._Pass.borrowers
    planner._Pass.borrowers = _borrowers_walking_everyone
    try:
        assert plan(s) == fast
    finally:
        planner._Pass.borrowers = kept


@given(snapshots())
def test_order_is_a_permutation_of_the_pending_jobs(s):
    assert sorted(plan(s).order) == sorted(j.job_id for j in s.pending)


@given(snapshots())
def test_plan_is_deterministic(s):
    assert plan(s) == plan(s)


@given(snapshots())
def test_bursts_respect_delay_budget_and_pool_size(s):
    d = plan(s)
    jobs = {j.job_id: j for j in s.pending}
    asked: dict[int, int] = {}
    assert len({b.job_id for b in d.bursts}) == len(d.bursts)
    for b in d.bursts:
        j, pool = jobs[b.job_id], s.pools[b.pool_id]
        assert pool.kind == "cloud" and pool in eligible_pools(s, j)
        assert j.budget_ok and j.placement != OWNED
        assert s.now - j.queued_at >= pool.burst_delay_s
        assert j.gpus_per_node <= pool.gpus_per_node
        assert b.spot == (pool.spot and j.spot_allowed)
        assert b.job_id not in placed(d)
        asked[b.pool_id] = asked.get(b.pool_id, 0) + b.nodes
    for pool_id, count in asked.items():
        have = sum(1 for n in s.nodes if n.pool_id == pool_id)
        assert have + count <= s.pools[pool_id].max_nodes


def test_a_large_queue_plans_quickly():
    """A smoke test of the indexes: 2,000 nodes and 5,000 jobs well inside a second."""
    nodes = [node(i, rack=i // 8) for i in range(2000)]
    pending = [
        job(i, team=i % 50, nodes=1 + i % 4, gpus=8, limit=HOUR * (1 + i % 5)) for i in range(5000)
    ]
    started = time.perf_counter()
    d = plan(snap(nodes, pending))
    assert time.perf_counter() - started < 2.0
    assert len(d.placements) + len(d.waits) == 5000
