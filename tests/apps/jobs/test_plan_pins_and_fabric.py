"""The planner's pinned jobs (Pending.node_ids) and degraded fabric (NodeSlot.degraded):
one example per rule, then their invariants on random small fleets.

Plain data in and out, with test_plan's builders: no database, no Django.
"""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from apps.jobs.scheduler.plan import plan
from apps.jobs.scheduler.snapshot import OWNED_THEN_CLOUD, Quota, Window
from tests.apps.jobs.test_plan import (
    HOUR,
    NOW,
    blocks,
    cloud,
    eligible_pools,
    free_at,
    job,
    node,
    nodes_of,
    owned,
    placed,
    replay,
    run,
    snap,
    snapshots,
    teams_on,
    tenancy_allows,
)

# --- pinned jobs ----------------------------------------------------------------------------


def test_a_pinned_job_runs_on_exactly_its_nodes():
    """Rack 1's two nodes would be the tighter fit for a gang of two; the pin wins."""
    nodes = [node(1, rack=1), node(2, rack=1), node(3, rack=2), node(4, rack=2), node(5, rack=2)]
    d = plan(snap(nodes, [job(1, nodes=2, node_ids={3, 5})]))
    assert placed(d)[1] == ((3, 8), (5, 8))
    assert not d.waits


def test_a_pinned_job_waits_for_a_busy_node_says_which_and_reserves_its_nodes():
    nodes = [node(i, shared=False) for i in range(1, 5)]
    s = snap(
        nodes,
        [
            job(1, nodes=2, node_ids={3, 4}, priority=2),
            job(2, gpus=8, limit=HOUR / 2),  # ends before the pinned start: may use node 3
            job(3, gpus=8, limit=3 * HOUR),  # would still run then: waits
        ],
        running=[
            run(10, [(4, 8)], ends_in=HOUR),
            run(11, [(1, 8)], ends_in=5 * HOUR),
            run(12, [(2, 8)], ends_in=5 * HOUR),
        ],
    )
    d = plan(s)
    assert 1 not in placed(d)
    w = d.waits[1]
    assert w.reason.startswith("waiting for its 2 pinned nodes (8 H100 each): node 4 busy")
    assert "(reserved)" in w.reason
    assert w.estimated_start == NOW + HOUR
    assert nodes_of(d, 2) == [3] and placed_backfilled(d, 2)
    assert 3 not in placed(d)
    # Without the pinned job and its reservation, job 3 takes node 3.
    assert nodes_of(plan(replace(s, pending=(s.pending[2],))), 3) == [3]
    assert not d.preemptions and not d.bursts


def placed_backfilled(d, job_id) -> bool:
    return next(p.backfilled for p in d.placements if p.job_id == job_id)


def test_a_pinned_job_on_a_node_that_is_gone_or_not_schedulable_waits_saying_so():
    nodes = [node(1), node(2, schedulable=False), node(3)]
    d = plan(snap(nodes, [job(1, nodes=2, node_ids={1, 99}), job(2, nodes=2, node_ids={1, 2})]))
    assert not d.placements
    assert (
        d.waits[1].reason
        == "waiting for its 2 pinned nodes (8 H100 each): node 99 gone from the fleet"
    )
    assert (
        d.waits[2].reason == "waiting for its 2 pinned nodes (8 H100 each): node 2 not schedulable"
    )
    assert d.waits[2].estimated_start is None


def test_a_pinned_job_never_preempts_nor_bursts():
    pools = {1: owned(1), 9: cloud(9, burst_delay_s=0)}
    s = snap(
        [node(1), node(2)],
        [job(1, nodes=2, priority=3, node_ids={1, 2}, placement=OWNED_THEN_CLOUD, waited=HOUR)],
        pools=pools,
        running=[run(10, [(1, 8)], priority=0), run(11, [(2, 8)], priority=0)],
    )
    d = plan(s)
    assert not d.placements and not d.preemptions and not d.bursts
    assert d.waits[1].reason.startswith(
        "waiting for its 2 pinned nodes (8 H100 each): nodes 1 and 2 busy"
    )
    # The same job unpinned preempts: the rule is the pin's, not the fleet's.
    unpinned = plan(replace(s, pending=(s.pending[0]._replace(node_ids=None),)))
    assert unpinned.preemptions


def test_a_pinned_job_keeps_windows_and_waits_past_them():
    window = Window(id=1, node_ids=frozenset({2}), team_id=None, start=NOW, end=NOW + 2 * HOUR)
    d = plan(snap([node(1), node(2)], [job(1, nodes=2, node_ids={1, 2})], windows=(window,)))
    assert not d.placements
    assert "node 2 held back by a window" in d.waits[1].reason
    assert d.waits[1].estimated_start == NOW + 2 * HOUR


def test_a_pinned_gang_takes_no_node_another_team_holds_and_a_one_node_pin_its_own():
    nodes = [node(1, shared=False), node(2, shared=False)]
    running = [run(10, [(1, 4)], team=5)]
    d = plan(
        snap(
            nodes,
            [
                job(1, team=6, nodes=2, gpus=4, node_ids={1, 2}),
                job(2, team=5, gpus=4, node_ids={1}),
            ],
            running=running,
        )
    )
    assert "node 1 busy (a team's jobs: one team per node)" in d.waits[1].reason
    assert placed(d)[2] == ((1, 4),)  # team 5's own node: its spare GPUs


def test_a_pinned_job_counts_against_its_quota_and_ignores_degraded_fabric():
    nodes = [node(1, degraded=True), node(2, degraded=True), node(3), node(4)]
    over = snap(
        nodes,
        [job(1, nodes=2, node_ids={1, 2})],
        running=[run(10, [(3, 8)], team=1)],
        quotas={(1, "H100"): Quota(nominal=16)},
    )
    assert plan(over).waits[1].reason == "waiting for 16 H100: team quota 8/16 in use"
    d = plan(snap(nodes, [job(1, nodes=2, node_ids={1, 2}), job(2, nodes=2)]))
    assert nodes_of(d, 1) == [1, 2]  # ops chose them: degradation does not matter
    assert nodes_of(d, 2) == [3, 4]


def test_a_pinned_job_whose_nodes_lie_in_two_pools_or_miscount_waits_saying_so():
    nodes = [node(1, pool=1), node(2, pool=2), node(3, pool=1)]
    d = plan(snap(nodes, [job(1, nodes=2, node_ids={1, 2}), job(2, nodes=1, node_ids={1, 3})]))
    assert not d.placements
    assert d.waits[1].reason.endswith("they lie in pools 1, 2, and a job runs in one pool")
    assert d.waits[2].reason.endswith("it asks for 1 node, not 2")


# --- degraded fabric ------------------------------------------------------------------------


def test_a_gang_leaves_degraded_nodes_while_healthy_ones_hold_it():
    """Rack 1 (degraded) is the tighter fit; the gang takes rack 2's healthy nodes."""
    nodes = [node(1, rack=1, degraded=True), node(2, rack=1, degraded=True)]
    nodes += [node(3, rack=2), node(4, rack=2), node(5, rack=2)]
    d = plan(snap(nodes, [job(1, nodes=2)]))
    assert nodes_of(d, 1) == [3, 4]
    # Without the flag, the tighter rack: the degradation is what moved it.
    clean = plan(snap([n._replace(degraded=False) for n in nodes], [job(1, nodes=2)]))
    assert nodes_of(clean, 1) == [1, 2]


def test_a_gang_takes_degraded_nodes_when_it_cannot_be_placed_without_them():
    nodes = [node(1, degraded=True), node(2), node(3)]
    d = plan(snap(nodes, [job(1, nodes=3)]))
    assert nodes_of(d, 1) == [1, 2, 3]


def test_a_healthy_pool_beats_a_degraded_one_of_the_same_kind():
    nodes = [node(1, pool=1, degraded=True), node(2, pool=1), node(3, pool=2), node(4, pool=2)]
    d = plan(snap(nodes, [job(1, nodes=2)]))
    assert nodes_of(d, 1) == [3, 4]


def test_a_one_node_job_takes_a_degraded_node_as_any_other():
    """Its traffic stays on the node: the tightest node wins, degraded or not."""
    nodes = [node(1, degraded=True), node(2)]
    d = plan(snap(nodes, [job(1, gpus=4)], running=[run(10, [(1, 4)])]))
    assert placed(d)[1] == ((1, 4),)


# --- invariants -----------------------------------------------------------------------------


def usable_now(s, j, n, teams) -> bool:
    """Whether node n has room for j now, before the pass placed anything."""
    return (
        n.schedulable
        and n.gpus_free >= j.gpus_per_node
        and tenancy_allows(n, j, teams.get(n.id, set()))
        and not any(n.id in w.node_ids and blocks(w, j, s.now) for w in s.windows)
    )


@given(snapshots())
def test_a_gang_uses_a_degraded_node_only_when_healthy_ones_could_not_hold_it(s):
    """Replaying the placements made before any job blocked their pool (so no reservation
    stands in the way): a gang on a degraded node is in a pool whose healthy nodes with room
    for it (free GPUs, tenancy, windows) were fewer than its nodes."""
    nodes = {n.id: n for n in s.nodes}
    for p, j, free, teams in replay(s, plan(s)):
        ids = [x for x, _ in p.node_gpus]
        if len(ids) > 1 and not p.backfilled and any(nodes[x].degraded for x in ids):
            healthy = [
                y
                for y, f in free.items()
                if nodes[y].pool_id == p.pool_id
                and not nodes[y].degraded
                and f >= j.gpus_per_node
                and (nodes[y].shared or not teams.get(y))
                and not any(y in w.node_ids and blocks(w, j, s.now) for w in s.windows)
            ]
            assert len(healthy) < len(ids), (p, healthy)


@st.composite
def pinned_snapshots(draw):
    """Random fleets where about half the pending jobs are pinned to one to three of the
    fleet's nodes (so at times of several pools), now and then with a node that is gone."""
    s = draw(snapshots())
    ids = [n.id for n in s.nodes]
    pending = []
    for j in s.pending:
        if ids and draw(st.booleans()):
            pinned = set(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True)))
            if draw(st.integers(0, 9)) == 0:
                pinned.add(999)
            j = j._replace(node_ids=frozenset(pinned), nodes=len(pinned), min_nodes=0)
        pending.append(j)
    return replace(s, pending=tuple(pending))


@given(pinned_snapshots())
def test_pinned_jobs_run_on_their_nodes_or_wait_and_never_preempt_nor_burst(s):
    d = plan(s)
    jobs = {j.job_id: j for j in s.pending}
    nodes = {n.id: n for n in s.nodes}
    booked: dict[int, int] = {}
    for p in d.placements:
        j = jobs[p.job_id]
        if j.node_ids is not None:
            assert {x for x, _ in p.node_gpus} == j.node_ids
            assert all(g == j.gpus_per_node for _, g in p.node_gpus)
            assert p.pool_id in {pool.id for pool in eligible_pools(s, j)}
        for x, g in p.node_gpus:
            assert nodes[x].schedulable
            booked[x] = booked.get(x, 0) + g
    for x, g in booked.items():
        assert g <= nodes[x].gpus_free
    pinned = {j.job_id for j in s.pending if j.node_ids is not None}
    assert not pinned & {b.job_id for b in d.bursts}
    assert not pinned & {p.for_job_id for p in d.preemptions}
    assert set(placed(d)) | set(d.waits) == set(jobs)
    # A pinned job's estimated start: all its nodes have room for it then.
    for job_id in pinned:
        w = d.waits.get(job_id)
        if w is None or w.estimated_start is None:
            continue
        j = jobs[job_id]
        free = free_at(s, d, w.estimated_start)
        teams = teams_on(s, d, w.estimated_start)
        for x in j.node_ids:
            assert free[x] >= j.gpus_per_node
            assert tenancy_allows(nodes[x], j, teams.get(x, set()))
            assert not any(
                x in win.node_ids and blocks(win, j, w.estimated_start) for win in s.windows
            )


@given(pinned_snapshots())
def test_a_pinned_job_at_the_head_of_the_queue_starts_whenever_its_nodes_have_room(s):
    d = plan(s)
    if not d.order:
        return
    j = next(p for p in s.pending if p.job_id == d.order[0])
    nodes = {n.id: n for n in s.nodes}
    if j.node_ids is None or not j.node_ids <= nodes.keys():
        return
    pools = {nodes[x].pool_id for x in j.node_ids}
    if len(pools) > 1 or not pools <= {p.id for p in eligible_pools(s, j)}:
        return
    gpu_type = s.pools[pools.pop()].gpu_type
    quota = s.quotas.get((j.team_id, gpu_type))
    held = sum(r.gpus for r in s.running if (r.team_id, r.gpu_type) == (j.team_id, gpu_type))
    if quota is not None and held + j.gpus > quota.limit:
        return
    teams = teams_on(s)
    if all(usable_now(s, j, nodes[x], teams) for x in j.node_ids):
        assert {x for x, _ in placed(d)[j.job_id]} == j.node_ids
    else:
        assert j.job_id not in placed(d)
