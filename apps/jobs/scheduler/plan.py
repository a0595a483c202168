"""One scheduling pass as a pure function: `plan(snapshot) -> decisions` (standard library only).

The pass walks the queue once, highest priority first, against an index of free
capacity per pool, and never scans every node for a job:

- per rack, how many nodes have at least k free GPUs, and per k the racks bucketed by
  that count, so the best-fitting rack for a gang is a few set look-ups;
- per exact free-GPU count a heap of nodes, so a one-node job takes the tightest node;
- per pool, how many nodes have at least k free GPUs, so a job that cannot fit fails
  in O(1) and a full fleet costs the rest of the queue nothing but reasons.

The first job that cannot start in a pool gets a shadow reservation (EASY backfill):
the nodes it would get at its earliest start, worked out from the time limits of what
runs there. Per pool and GPUs-per-node size, a sorted list says when each node will
have that many GPUs free and no reservation on it; the pass keeps it up to date as it
books and reserves nodes, so an earliest start is the n-th entry. Later jobs may take
reserved nodes only if they end by the reservation's start. After the first blocked
job each pool tries at most `backfill_depth` more jobs (Slurm's bf_max_job_test); the
jobs after that are told they wait behind higher ones. Every blocked job tried gets a
reservation of its own, on nodes that no earlier reservation holds at that time.

Jobs are untrusted code, so a node that is not `shared` (NodeSlot) holds one team's jobs at
a time. Such a node with jobs on it is owned by their team (by nobody, and usable by nobody
until they all end, if it holds several teams' jobs from before this rule): its free GPUs
leave the index above, which stays team-agnostic, for the owner's own side index
(`spare[team][node]`), and what it gives back to the index is the whole node when its last
job ends. A one-node job takes the tightest of its team's own nodes that fits before it
looks at the index; a gang takes only what the index has (nodes no team owns, and shared
ones), which keeps its rack search as it is. Preemption frees such a node for another
team only by stopping every job on it. Shared nodes are planned as before.

A job with a node range (min_nodes below nodes, as Slurm's --nodes=min-max) is placed
whole when it fits. Only when it does not is it given the most nodes that fit now in
one pool, never fewer than min_nodes; if not even those fit, it waits (and reserves,
preempts or bursts) for its whole gang. Its gang is narrowed first to what an eligible
pool can ever hold and its team's quota has room for. Quotas count the GPUs placed. A
job without a range costs the walk one comparison.

A gang's traffic crosses the fabric, so it takes nodes whose fabric is degraded (NodeSlot
.degraded) only when it cannot be placed without them: each pool keeps the degraded nodes
with free GPUs (`degraded_free`), a gang's search leaves them out first, and a fit that
needs them scores after every healthy one. One-node jobs take them as any other node.

A pinned job (Pending.node_ids: a tuning run measuring the nodes ops chose) runs on exactly
those nodes, all in one pool, each with gpus_per_node free to it now (windows, reservations
and tenancy as for any job; degradation does not matter), or waits, saying which of them
stand in the way, and reserves them for the earliest time they are all free. It never goes
elsewhere, never bursts and never preempts. Quotas and the backfill depth count it as any
job. The snapshot's nodes are looked up by id only once a pinned job is in the queue.
"""

import heapq
import time
from bisect import bisect_left, bisect_right, insort

from apps.jobs.scheduler.priority import queue_order
from apps.jobs.scheduler.snapshot import (
    ANY_GPU,
    BEYOND,
    CLOUD,
    OWNED,
    OWNED_THEN_CLOUD,
    BurstRequest,
    Decisions,
    NodeSlot,
    Pending,
    Placement,
    PoolInfo,
    Preemption,
    Running,
    Snapshot,
    Wait,
    Window,
)

CLASS_NAMES = {0: "low", 1: "normal", 2: "high", 3: "urgent"}
INFINITY = float("inf")
NO_NODES: frozenset[int] = frozenset()
KINDS_FOR = {OWNED: ("owned",), CLOUD: ("cloud",), OWNED_THEN_CLOUD: ("owned", "cloud")}


def plan(snapshot: Snapshot) -> Decisions:
    """Place what fits now, reserve for what does not, preempt and burst where allowed."""
    return _Pass(snapshot).run()


# --- words ---------------------------------------------------------------------------------


def clock(moment: float, now: float) -> str:
    """HH:MM UTC, with the date in front when it is not today's."""
    t = time.gmtime(moment)
    hm = f"{t.tm_hour:02d}:{t.tm_min:02d} UTC"
    if time.gmtime(now)[:3] != t[:3]:
        return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d} {hm}"
    return hm


def _nodes_word(count: int) -> str:
    return "1 node" if count == 1 else f"{count} nodes"


def _gpu_word(job: Pending) -> str:
    return "GPUs of any type" if job.gpu_type == ANY_GPU else job.gpu_type


def _what(job: Pending) -> str:
    """'2 × 8 H100' for a gang, '4 H100' for one node."""
    if job.nodes == 1:
        return f"{job.gpus_per_node} {_gpu_word(job)}"
    return f"{job.nodes} × {job.gpus_per_node} {_gpu_word(job)}"


def _ids_word(ids: list[int]) -> str:
    """'node 12', 'nodes 12 and 14', 'nodes 12, 14, 15 and 3 more' (ids: the snapshot has
    no names)."""
    if len(ids) == 1:
        return f"node {ids[0]}"
    shown = [str(x) for x in ids[:3]]
    rest = len(ids) - len(shown)
    if rest:
        return f"nodes {', '.join(shown)} and {rest} more"
    return f"nodes {', '.join(shown[:-1])} and {shown[-1]}"


def _pinned_words(job: Pending) -> str:
    """'waiting for its 2 pinned nodes (8 H100 each)', or its one pinned node."""
    count = len(job.node_ids)
    if count == 1:
        return f"waiting for its pinned node ({job.gpus_per_node} {_gpu_word(job)})"
    return f"waiting for its {count} pinned nodes ({job.gpus_per_node} {_gpu_word(job)} each)"


def _blocks(w: Window, team: int, start: float, end: float) -> bool:
    """Whether window w keeps a job of `team` running over [start, end) off its nodes."""
    return (w.team_id is None or w.team_id != team) and start < w.end and end > w.start


# --- the free-capacity index of one pool -----------------------------------------------------


class PoolCapacity:
    """One pool's schedulable nodes and their free GPUs, indexed for best-fit look-ups.

    Within a pass GPUs are only taken, never given back, so the free counts only fall.
    """

    __slots__ = (
        "attempts",
        "blocked_seen",
        "bucket",
        "burst_nodes",
        "degraded_free",
        "exhausted",
        "free",
        "gpu_type",
        "gpus_max",
        "heaps",
        "held_cnt",
        "holding",
        "id",
        "info",
        "is_cloud",
        "levels",
        "max_rack",
        "node_count",
        "node_windows",
        "nodes_with",
        "now",
        "owner",
        "placed_on",
        "pool_cnt",
        "rack_cnt",
        "rack_nodes",
        "rack_of",
        "ready_cache",
        "releases",
        "reserved",
        "reserved_free",
        "reserved_until",
        "shared",
        "spare",
        "victim_order",
        "window_nodes",
        "windows",
    )

    def __init__(
        self,
        info: PoolInfo,
        nodes: list[NodeSlot],
        now: float,
        sizes: set[int],
        holding: dict[int, list[int]],
        last_end: dict[int, float],
    ):
        """`sizes`: the GPUs per node that jobs ask for; only those levels are kept up to
        date as GPUs are taken (the counts for other levels go stale). `holding`: node ->
        the team of each running job on it; `last_end`: node -> when the last one ends."""
        self.info = info
        self.now = now
        self.id = info.id
        self.gpu_type = info.gpu_type
        self.is_cloud = info.kind == "cloud"
        self.node_count = len(nodes)  # every node the pool has, for its burst limit
        self.burst_nodes = 0  # nodes asked for by this pass's burst requests
        self.gpus_max = g_max = max((n.gpus_total for n in nodes), default=0)
        # nodes_with[g]: how many nodes (schedulable or not) have at least g GPUs in all.
        totals = [0] * (g_max + 2)
        for n in nodes:
            if n.gpus_total > 0:
                totals[n.gpus_total] += 1
        self.nodes_with = with_ = [0] * (g_max + 1)
        running_sum = 0
        for g in range(g_max, -1, -1):
            running_sum += totals[g]
            with_[g] = running_sum

        # Racks in the order of their ids (no rack last), so the lowest position is the lowest id.
        schedulable = sorted(
            (n for n in nodes if n.schedulable and n.gpus_total > 0),
            key=lambda n: (n.rack_id is None, n.rack_id or 0, n.id),
        )
        rack_pos: dict = {}
        rack_nodes: list[list[int]] = []
        free: dict[int, int] = {}
        rack_of: dict[int, int] = {}
        # node -> (time, GPUs) coming back as running jobs and this pass's reach their limits.
        self.releases: dict[int, list[tuple[float, int]]] = {}
        releases = self.releases
        self.shared: set[int] = set()
        shared = self.shared
        # Nodes that are not shared and hold jobs, and their team (None: several teams).
        # Their free GPUs are in spare[team] (node -> free GPUs), not in the index, and
        # they come back to it whole when their last job ends. `holding` and `placed_on`
        # (nodes given a job by this pass) say how many jobs each holds.
        self.owner: dict[int, int | None] = {}
        owner = self.owner
        self.spare: dict[int, dict[int, int]] = {}
        spare = self.spare
        self.holding = holding
        self.placed_on: set[int] = set()
        # Degraded nodes with free GPUs in the index: what a gang's search leaves out first.
        self.degraded_free: set[int] = set()
        degraded_free = self.degraded_free
        held_free = [0] * (g_max + 2)
        for n in schedulable:
            x = n.id
            pos = rack_pos.get(n.rack_id)
            if pos is None:
                pos = rack_pos[n.rack_id] = len(rack_nodes)
                rack_nodes.append([])
            rack_nodes[pos].append(x)
            f = n.gpus_free
            f = 0 if f < 0 else (n.gpus_total if f > n.gpus_total else f)
            if n.shared:
                shared.add(x)
            elif teams := holding.get(x):
                team = teams[0]
                if len(teams) > 1 and teams.count(team) < len(teams):
                    team = None  # from before this rule: nobody may add to it
                owner[x] = team
                releases[x] = [(last_end[x], n.gpus_total)]
                if f:
                    if team is not None:
                        mine = spare.get(team)
                        if mine is None:
                            spare[team] = {x: f}
                        else:
                            mine[x] = f
                    held_free[f] += 1
                    f = 0
            free[x] = f
            rack_of[x] = pos
            if f and n.degraded:
                degraded_free.add(x)
        self.free = free
        self.rack_of = rack_of
        self.rack_nodes = rack_nodes
        self.max_rack = max_rack = max((len(r) for r in rack_nodes), default=0)
        self.levels = levels = sorted(k for k in sizes if 0 < k <= g_max)

        rack_cnt = []
        pool_cnt = [0] * (g_max + 1)
        heaps: list[list[int]] = [[] for _ in range(g_max + 1)]
        bucket = [[set() for _ in range(max_rack + 1)] for _ in range(g_max + 1)]
        for r, members in enumerate(rack_nodes):
            per_free = [0] * (g_max + 2)
            for x in members:
                f = free[x]
                per_free[f] += 1
                if f:
                    heaps[f].append(x)
            counts = [0] * (g_max + 1)
            c = 0
            for k in range(g_max, 0, -1):
                c += per_free[k]
                counts[k] = c
                pool_cnt[k] += c
            for k in levels:
                if counts[k]:
                    bucket[k][counts[k]].add(r)
            counts[0] = len(members)
            rack_cnt.append(counts)
        for h in heaps:
            heapq.heapify(h)
        self.rack_cnt = rack_cnt
        self.pool_cnt = pool_cnt
        self.bucket = bucket
        self.heaps = heaps
        # held_cnt[k] (k in levels): owned nodes with at least k free GPUs, for the reasons.
        self.held_cnt = held_cnt = [0] * (g_max + 1)
        c = 0
        for k in range(g_max, 0, -1):
            c += held_free[k]
            held_cnt[k] = c

        # g -> (sorted (time, node), node -> time): when each node outside any window has g
        # free GPUs and no reservation holding it; built on first use, then kept up to date.
        self.ready_cache: dict[int, tuple[list[tuple[float, int]], dict[int, float]]] = {}
        self.victim_order: list[Running] = []
        self.windows: list[tuple[Window, frozenset[int]]] = []
        self.window_nodes: set[int] = set()
        self.node_windows: dict[int, list[Window]] = {}
        self.reserved: dict[int, float] = {}  # node -> start of its first reservation
        self.reserved_until: dict[int, float] = {}  # node -> end of its last reservation
        self.reserved_free: set[int] = set()  # reserved nodes with a free GPU now
        self.blocked_seen = False  # a job that could use this pool could not start
        self.attempts = 0  # jobs tried here since then
        self.exhausted = False  # attempts reached the backfill depth

    def _held_moved(self, old: int, new: int) -> None:
        """An owned node's free GPUs went from old to new: keep held_cnt's levels right."""
        held_cnt = self.held_cnt
        for k in self.levels:
            if old < k <= new:
                held_cnt[k] += 1
            elif new < k <= old:
                held_cnt[k] -= 1

    # -- looking ---------------------------------------------------------------------------

    def count_fitting(self, g: int, blocked=NO_NODES) -> int:
        """Nodes with at least g free GPUs, leaving out `blocked`."""
        if g > self.gpus_max:
            return 0
        free = self.free
        return self.pool_cnt[g] - sum(1 for x in blocked if free.get(x, 0) >= g)

    def best_fit(self, n: int, g: int, blocked) -> tuple[tuple, list[int]] | None:
        """The tightest place for n nodes of g free GPUs now: (score, node ids), or None.

        Lower scores are tighter: (0, spare) for one node or one rack, (1, racks, spare)
        for a gang across racks. `blocked` holds the nodes with free GPUs it may not use.
        """
        if g > self.gpus_max or g <= 0:
            return None
        if n == 1:
            return self._best_node(g, blocked)
        free = self.free
        rack_of = self.rack_of
        dec: dict[int, int] = {}
        for x in blocked:
            if free.get(x, 0) >= g:
                r = rack_of[x]
                dec[r] = dec.get(r, 0) + 1
        if self.pool_cnt[g] - sum(dec.values()) < n:
            return None
        bucket = self.bucket[g]
        max_rack = self.max_rack
        if dec:
            # A view of the buckets with the blocked nodes' racks moved down.
            rack_cnt = self.rack_cnt
            moved: list[list[int]] = [[] for _ in range(max_rack + 1)]
            for r, d in dec.items():
                moved[rack_cnt[r][g] - d].append(r)

            def racks_with(c: int):
                racks = [r for r in bucket[c] if r not in dec]
                racks.extend(moved[c])
                return racks
        else:

            def racks_with(c: int):
                return bucket[c]

        for c in range(n, max_rack + 1):  # one rack, the one left with the fewest spare nodes
            racks = racks_with(c)
            if racks:
                r = min(racks)
                return (0, c - n), self._pick_in_rack(r, n, g, blocked)
        # Across racks: whole racks, fullest first, then the tightest rack for the rest.
        chosen: list[tuple[int, int]] = []
        taken: set[int] = set()
        rest = n
        spare = 0
        for c in range(max_rack, 0, -1):
            racks = racks_with(c)
            if not racks:
                continue
            if c <= rest:
                k = rest // c
                pick = sorted(racks) if k >= len(racks) else heapq.nsmallest(k, racks)
                chosen.extend((r, c) for r in pick)
                taken.update(pick)
                rest -= c * len(pick)
                if rest == 0:
                    break
            if c > rest or len(pick) < len(racks):
                # The remainder is smaller than what is left of the bigger racks: best fit.
                for c2 in range(rest, max_rack + 1):
                    left = [r for r in racks_with(c2) if r not in taken]
                    if left:
                        chosen.append((min(left), rest))
                        spare = c2 - rest
                        rest = 0
                        break
                break
        if rest:
            return None  # cannot happen: the pool count said there was room
        picked: list[int] = []
        for r, take in chosen:
            picked.extend(self._pick_in_rack(r, take, g, blocked))
        return (1, len(chosen), spare), picked

    def _best_node(self, g: int, blocked) -> tuple[tuple, list[int]] | None:
        free = self.free
        heaps = self.heaps
        for f in range(g, self.gpus_max + 1):
            h = heaps[f]
            skipped = []
            found = None
            while h:
                x = h[0]
                if free[x] != f:  # stale: the node has fewer free GPUs now
                    heapq.heappop(h)
                elif x in blocked:
                    skipped.append(heapq.heappop(h))
                else:
                    found = x
                    break
            for x in skipped:
                heapq.heappush(h, x)
            if found is not None:
                return (0, f - g), [found]
        return None

    def _pick_in_rack(self, r: int, n: int, g: int, blocked) -> list[int]:
        """The n nodes of rack r with the fewest free GPUs that still fit."""
        free = self.free
        fits = sorted((free[x], x) for x in self.rack_nodes[r] if free[x] >= g and x not in blocked)
        return [x for _, x in fits[:n]]

    # -- booking ---------------------------------------------------------------------------

    def book(self, x: int, gpus: int, until: float, team: int) -> None:
        """Give a placement of `team` `gpus` GPUs of node x, which come back at `until`."""
        if x in self.shared:
            self.take(x, gpus)
            insort(self.releases.setdefault(x, []), (until, gpus))
        elif x in self.owner:  # one of the team's own nodes (_Pass.spare_fit)
            mine = self.spare[team]
            f = mine[x]
            if f > gpus:
                mine[x] = f - gpus
            else:
                del mine[x]
            self._held_moved(f, f - gpus)
            last, whole = self.releases[x][0]
            if until > last:
                self.releases[x] = [(until, whole)]
        else:  # nobody holds it: from now on the team owns it
            f = self.free[x]
            self.take(x, f)
            if f > gpus:
                self.spare.setdefault(team, {})[x] = f - gpus
                self._held_moved(0, f - gpus)
            self.owner[x] = team
            self.releases[x] = [(until, f)]
        self.placed_on.add(x)
        self.refresh(x)

    def take(self, x: int, gpus: int) -> None:
        free = self.free
        a = free[x]
        b = a - gpus
        free[x] = b
        r = self.rack_of[x]
        counts = self.rack_cnt[r]
        bucket = self.bucket
        pool_cnt = self.pool_cnt
        for k in self.levels:
            if k <= b:
                continue
            if k > a:
                break
            c = counts[k]
            bk = bucket[k]
            bk[c].discard(r)
            c -= 1
            counts[k] = c
            if c:
                bk[c].add(r)
            pool_cnt[k] -= 1
        if b > 0:
            heapq.heappush(self.heaps[b], x)
        else:
            self.reserved_free.discard(x)
            self.degraded_free.discard(x)

    def reserve(self, nodes, start: float, until: float) -> None:
        """Hold nodes for a blocked job from `start` to `until` (INFINITY: no known end).

        Jobs placed now may use them only if they end by the first reservation's start;
        later reservations may use them only after the last one's end.
        """
        free = self.free
        for x in nodes:
            if x not in self.reserved:
                self.reserved[x] = start
            self.reserved_until[x] = until
            if free[x] > 0:
                self.reserved_free.add(x)
            self.refresh(x)

    # -- the future --------------------------------------------------------------------------

    def ready_at(self, x: int, g: int) -> float:
        """When node x has g free GPUs and no reservation holds it (INFINITY: never)."""
        f = self.free[x]
        t = self.now
        if f < g:
            t = INFINITY
            for when, gpus in self.releases.get(x, ()):
                f += gpus
                if f >= g:
                    t = when
                    break
        held_until = self.reserved_until.get(x)
        return t if held_until is None or held_until <= t else held_until

    def ready_list(self, g: int) -> list[tuple[float, int]]:
        cached = self.ready_cache.get(g)
        if cached is None:
            window_nodes = self.window_nodes
            times = {x: self.ready_at(x, g) for x in self.free if x not in window_nodes}
            cached = self.ready_cache[g] = (sorted((t, x) for x, t in times.items()), times)
        return cached[0]

    def refresh(self, x: int) -> None:
        """Move node x in the ready lists after its free GPUs or reservations changed."""
        if x in self.window_nodes:
            return
        for g, (ready, times) in self.ready_cache.items():
            old, new = times[x], self.ready_at(x, g)
            if new != old:
                del ready[bisect_left(ready, (old, x))]
                insort(ready, (new, x))
                times[x] = new

    def window_usable(self, x: int, team: int, start: float, end: float) -> bool:
        return not any(_blocks(w, team, start, end) for w in self.node_windows.get(x, ()))

    def earliest_start(self, job: Pending) -> tuple[float, list[int]] | None:
        """When, at the earliest, n nodes with g free GPUs are usable by the job, and which.

        Capacity comes back as running jobs and this pass's placements reach their time
        limits. A node reserved for a higher job counts only after that reservation ends
        (so reservations never overlap); a node under a window only at times it allows.
        """
        g, n = job.gpus_per_node, job.nodes
        if g > self.gpus_max or self.nodes_with[g] < n or len(self.free) < n:
            return None
        ready = self.ready_list(g)
        if not self.window_nodes:
            if len(ready) < n or ready[n - 1][0] == INFINITY:
                return None
            start = ready[n - 1][0]
            return start, self._pick_ready(ready, n, start, [])
        # Window nodes count only while their windows allow the job: try each time at
        # which the count of usable nodes can rise, in order.
        team, tl = job.team_id, job.time_limit_s
        watched = [(t, x) for x in self.window_nodes if (t := self.ready_at(x, g)) < INFINITY]
        times = {t for t, _ in watched}
        times.update(w.end for w, _ in self.windows if w.end > self.now)
        times.update(t for t, _ in ready[max(0, n - len(watched) - 1) : n])
        for t in sorted(times):
            if t == INFINITY:
                break
            count = bisect_right(ready, (t, INFINITY))
            if count >= n:
                return t, self._pick_ready(ready, n, t, [])
            usable = [x for tx, x in watched if tx <= t and self.window_usable(x, team, t, t + tl)]
            if count + len(usable) >= n:
                return t, self._pick_ready(ready, n, t, sorted(usable))
        return None

    def _pick_ready(self, ready, n: int, start: float, usable: list[int]) -> list[int]:
        """n nodes for a reservation at `start`: those busy now first (what is free now
        stays free for backfill), then window nodes, then nodes free now."""
        upto = bisect_right(ready, (start, INFINITY))
        free_now = bisect_right(ready, (self.now, INFINITY))
        picked = [x for _, x in ready[free_now:upto][:n]]
        picked.extend(usable[: n - len(picked)])
        picked.extend(x for _, x in ready[: min(free_now, upto)][: n - len(picked)])
        return picked


# --- the pass -------------------------------------------------------------------------------


class _Pass:
    """The state of one pass; thrown away once it has returned its decisions."""

    def __init__(self, snapshot: Snapshot):
        self.snap = snapshot
        self.now = now = snapshot.now
        self.settings = snapshot.settings
        self.decisions = Decisions()
        by_pool: dict[int, list[NodeSlot]] = {pid: [] for pid in snapshot.pools}
        for n in snapshot.nodes:
            if n.pool_id in by_pool:
                by_pool[n.pool_id].append(n)
        sizes = {j.gpus_per_node for j in snapshot.pending}
        self.held: dict[tuple[int, str], int] = {}
        holding: dict[int, list[int]] = {}  # node -> the team of each running job on it
        last_end: dict[int, float] = {}  # node -> when the last of them ends
        for r in snapshot.running:
            team = r.team_id
            key = (team, r.gpu_type)
            self.held[key] = self.held.get(key, 0) + sum(g for _, g in r.node_gpus)
            end = r.expected_end if r.expected_end > now else now
            for x, _ in r.node_gpus:
                teams = holding.get(x)
                if teams is None:
                    holding[x] = [team]
                    last_end[x] = end
                else:
                    teams.append(team)
                    if end > last_end[x]:
                        last_end[x] = end
        self.pools = {
            pid: PoolCapacity(info, by_pool[pid], now, sizes, holding, last_end)
            for pid, info in sorted(snapshot.pools.items())
        }
        # Each job's GPUs come back at its end on shared nodes (the others' come back whole).
        pool_of = {x: pool for pool in self.pools.values() for x in pool.shared}
        for r in snapshot.running:
            if pool_of:
                end = r.expected_end if r.expected_end > now else now
                for x, gpus in r.node_gpus:
                    pool = pool_of.get(x)
                    if pool is not None:
                        pool.releases.setdefault(x, []).append((end, gpus))
            pool = self.pools.get(r.pool_id)
            if pool is not None:
                pool.victim_order.append(r)
        for pool in self.pools.values():
            for coming_back in pool.releases.values():
                coming_back.sort()
            # Lowest class first, then the youngest (the latest expected end) first.
            pool.victim_order.sort(key=lambda r: (r.priority, -r.expected_end, r.job_id))
        for w in sorted(snapshot.windows, key=lambda w: w.id):
            if w.end <= now:
                continue
            for pool in self.pools.values():
                mine = frozenset(x for x in w.node_ids if x in pool.free)
                if mine:
                    pool.windows.append((w, mine))
                    pool.window_nodes |= mine
                    for x in mine:
                        pool.node_windows.setdefault(x, []).append(w)
        self.quotas = snapshot.quotas
        self.limits = {key: q.nominal + q.borrow for key, q in snapshot.quotas.items()}
        # GPU type -> the teams holding more than their nominal quota of it: only their
        # jobs can be borrowers. Held only grows within a pass, so only _hold adds to it.
        self.over_nominal: dict[str, set[int]] = {}
        for (team_id, gpu_type), gpus in self.held.items():
            q = self.quotas.get((team_id, gpu_type))
            if q is not None and gpus > q.nominal:
                self.over_nominal.setdefault(gpu_type, set()).add(team_id)
        self.victims: set[int] = set()
        self.quota_waits: dict[tuple, Wait] = {}  # one Wait per wording, shared by its jobs
        self.nodes_by_id: dict[int, NodeSlot] | None = None  # built for the first pinned job
        self.depth = max(self.settings.backfill_depth, 0)

    # -- the walk ----------------------------------------------------------------------------

    def run(self) -> Decisions:
        decisions = self.decisions
        order = queue_order(self.snap)
        decisions.order = [job.job_id for job in order]
        waits = decisions.waits
        held = self.held
        limits = self.limits
        depth = self.depth
        shapes: dict[tuple, tuple] = {}
        beyond = BEYOND
        quota_waits = self.quota_waits
        quotas = self.quotas
        for job in order:
            shape = (job.gpu_type, job.placement, job.nodes, job.gpus_per_node)
            known = shapes.get(shape)
            if known is None:
                known = shapes[shape] = self.shape(job)
            if job.min_nodes and job.min_nodes < job.nodes and job.node_ids is None:
                job, known = self.widest_gang(job, known, shapes)
            pools, single_type, types, never = known
            if never is not None:
                waits[job.job_id] = never
                continue
            gpus = job.nodes * job.gpus_per_node
            team = job.team_id
            if single_type is not None:
                key = (team, single_type)
                limit = limits.get(key)
                if limit is not None and (h := held.get(key, 0)) + gpus > limit:
                    q = quotas[key]
                    wkey = (single_type, h, gpus, q.nominal, q.borrow)  # the words, not the team
                    w = quota_waits.get(wkey)
                    if w is None:
                        w = quota_waits[wkey] = Wait(self.quota_reason(job, [single_type]))
                    waits[job.job_id] = w
                    continue
                fitting = pools
            else:
                allowed = [
                    t
                    for t in types
                    if (limit := limits.get((team, t))) is None
                    or held.get((team, t), 0) + gpus <= limit
                ]
                if not allowed:
                    waits[job.job_id] = Wait(self.quota_reason(job, types))
                    continue
                fitting = (
                    pools
                    if len(allowed) == len(types)
                    else tuple(p for p in pools if p.gpu_type in allowed)
                )
            pinned = job.node_ids
            if pinned is not None:
                fitting = self.pinned_pool(job, pools, fitting)
                if fitting is None:
                    continue  # it waits, and said why
            for p in fitting:
                if not p.exhausted:
                    break
            else:
                waits[job.job_id] = beyond
                continue
            for p in fitting:
                if p.blocked_seen:
                    p.attempts += 1
                    if p.attempts >= depth:
                        p.exhausted = True
            if pinned is not None:
                placed = self.place_pinned(job, fitting[0])  # or it waits, saying for what
            else:
                placed = self.try_place(job, fitting) or bool(
                    job.min_nodes and job.min_nodes < job.nodes and self.place_fewer(job, pools)
                )
                if not placed:
                    self.blocked(job, fitting)
            if not placed:
                for p in fitting:
                    if not p.blocked_seen:
                        p.blocked_seen = True
                        p.exhausted = depth == 0
        return decisions

    def shape(self, job: Pending) -> tuple:
        """For jobs of one shape: (eligible pools, their GPU type if only one, all their GPU
        types, and a Wait when no eligible pool can ever hold the shape)."""
        pools = tuple(
            p
            for kind in KINDS_FOR.get(job.placement, ())
            for p in self.pools.values()
            if p.info.enabled
            and p.info.kind == kind
            and (job.gpu_type == ANY_GPU or p.gpu_type == job.gpu_type)
        )
        n, g = job.nodes, job.gpus_per_node
        can_hold = (
            n > 0
            and g > 0
            and any(
                (g <= p.gpus_max and p.nodes_with[g] >= n)
                or (p.is_cloud and p.info.max_nodes >= n and g <= p.info.gpus_per_node)
                for p in pools
            )
        )
        if not can_hold:
            word = "GPUs" if job.gpu_type == ANY_GPU else job.gpu_type
            where = {OWNED: " among owned pools", CLOUD: " among cloud pools"}.get(
                job.placement, ""
            )
            reason = f"no eligible pool can hold {_nodes_word(n)} of {g} {word}{where}"
            return pools, None, [], Wait(reason=reason)
        types = sorted({p.gpu_type for p in pools})
        return pools, (types[0] if len(types) == 1 else None), types, None

    def widest_gang(self, job: Pending, known: tuple, shapes: dict) -> tuple[Pending, tuple]:
        """A job with a node range as the widest gang it may have in this pass, and its
        shape: `nodes`, or fewer (not below min_nodes) when no eligible pool can ever hold
        that many nodes or the team's quota has room for fewer now. From here on the pass
        plans that gang: placed whole if it fits, else place_fewer, else it waits (and
        reserves, preempts or bursts) for it. Unchanged when not even min_nodes could go:
        it then waits as its whole gang would, with that gang's reason."""
        pools = known[0]
        n, g, team = job.nodes, job.gpus_per_node, job.team_id
        if g <= 0:
            return job, known
        hold = 0  # shape()'s can_hold, as a count
        for p in pools:
            if g <= p.gpus_max and p.nodes_with[g] > hold:
                hold = p.nodes_with[g]
            if p.is_cloud and g <= p.info.gpus_per_node and p.info.max_nodes > hold:
                hold = p.info.max_nodes
        room = 0  # the most nodes the team's quota of some eligible GPU type has room for
        for gpu_type in {p.gpu_type for p in pools}:
            limit = self.limits.get((team, gpu_type))
            if limit is None:
                room = n
                break
            room = max(room, (limit - self.held.get((team, gpu_type), 0)) // g)
        widest = min(n, hold, room)
        if widest == n or widest < job.min_nodes:
            return job, known
        job = job._replace(nodes=widest)
        shape = (job.gpu_type, job.placement, widest, g)
        known = shapes.get(shape)
        if known is None:
            known = shapes[shape] = self.shape(job)
        return job, known

    def place_fewer(self, job: Pending, pools: tuple[PoolCapacity, ...]) -> bool:
        """A job with a node range whose gang found no room now: place the most of its nodes
        that fit now in one eligible pool and its team's quota of that pool's GPU type, not
        below min_nodes, by try_place's rules (reservations, windows, tenancy)."""
        g, team = job.gpus_per_node, job.team_id
        limits, held = self.limits, self.held
        most = 0
        for p in pools:
            if g > p.gpus_max:
                continue
            count = p.count_fitting(g, self.blocked_nodes(job, p))
            limit = limits.get((team, p.gpu_type))
            if limit is not None:
                count = min(count, (limit - held.get((team, p.gpu_type), 0)) // g)
            most = max(most, count)
        fewer = min(most, job.nodes - 1)
        if fewer < job.min_nodes:
            if job.min_nodes > 1:
                return False
            fewer = 1  # one of the team's own nodes may have room (try_place's spare_fit)
        gpus = fewer * g
        fitting = tuple(
            p
            for p in pools
            if (limit := limits.get((team, p.gpu_type))) is None
            or held.get((team, p.gpu_type), 0) + gpus <= limit
        )
        return bool(fitting) and self.try_place(job._replace(nodes=fewer), fitting)

    def wait(self, job: Pending, reason: str, estimated_start: float | None = None) -> None:
        self.decisions.waits[job.job_id] = Wait(reason=reason, estimated_start=estimated_start)

    def quota_reason(self, job: Pending, types: list[str]) -> str:
        """'waiting for 64 H100: team quota 192/192 in use', or that the job alone is more
        than the whole quota."""
        what = f"{job.gpus} {'GPUs' if job.gpu_type == ANY_GPU else job.gpu_type}"
        quotas = [
            (t, self.quotas[(job.team_id, t)]) for t in types if (job.team_id, t) in self.quotas
        ]
        many = len(types) > 1
        if quotas and all(job.gpus > q.limit for _, q in quotas):
            if not many:
                q = quotas[0][1]
                split = f" ({q.nominal} nominal + {q.borrow} borrowable)" if q.borrow else ""
                whole = f"the team's whole {types[0]} quota of {q.limit}{split}"
                return f"waiting for {what}: more than {whole}"
            limits = ", ".join(f"{t} {q.limit}" for t, q in quotas)
            return f"waiting for {what}: more than the team's whole quota of any type ({limits})"
        parts = []
        for gpu_type, q in quotas:
            part = f"{self.held.get((job.team_id, gpu_type), 0)}/{q.limit}"
            if q.borrow:
                part += f" ({q.nominal} nominal + {q.borrow} borrowable)"
            parts.append(f"{gpu_type} {part}" if many else part)
        return f"waiting for {what}: team quota {', '.join(parts)} in use"

    def windows_in_way(self, job: Pending, pool: PoolCapacity, start: float) -> list:
        end = start + job.time_limit_s
        return [(w, nodes) for w, nodes in pool.windows if _blocks(w, job.team_id, start, end)]

    def blocked_nodes(self, job: Pending, pool: PoolCapacity):
        """Nodes with free GPUs that this job may not take now: those of windows it would
        overlap, and reserved ones it would still run on when the reservation starts."""
        if not pool.windows and not pool.reserved_free:
            return NO_NODES
        out: set[int] = set()
        for _, nodes in self.windows_in_way(job, pool, self.now):
            out |= nodes
        end = self.now + job.time_limit_s
        reserved = pool.reserved
        out.update(x for x in pool.reserved_free if reserved[x] < end)
        return out

    def try_place(self, job: Pending, pools: tuple[PoolCapacity, ...]) -> bool:
        """Place the job in the tightest pool of the first kind (owned, cloud) with room:
        a one-node job on one of its team's own nodes first (a score below any other)."""
        n, g = job.nodes, job.gpus_per_node
        best = best_pool = None
        for p in pools:
            if best is not None and p.is_cloud != best_pool.is_cloud:
                break  # an owned pool had room: cloud pools come only after
            # Only a one-node job looks at its team's own nodes: a gang takes what the index
            # has, so its rack search stays as it is (the team's gangs wait for empty nodes).
            if n == 1 and (mine := p.spare.get(job.team_id)):
                fit = self.spare_fit(job, p, mine)
                if fit is not None:
                    if best is None or fit[0] < best[0]:
                        best, best_pool = fit, p
                    continue
            if g > p.gpus_max or p.pool_cnt[g] < n:
                continue
            blocked = self.blocked_nodes(job, p)
            if n > 1 and p.degraded_free:
                # Healthy nodes first; a fit that needs degraded ones scores after them all.
                fit = p.best_fit(n, g, blocked | p.degraded_free)
                if fit is None and (fit := p.best_fit(n, g, blocked)) is not None:
                    fit = ((2, *fit[0]), fit[1])
            else:
                fit = p.best_fit(n, g, blocked)
            if fit is not None and (best is None or fit[0] < best[0]):
                best, best_pool = fit, p
        if best is None:
            return False
        p = best_pool
        nodes = best[1]
        end = self.now + job.time_limit_s
        for x in nodes:
            p.book(x, g, end, job.team_id)
        node_gpus = tuple((x, g) for x in nodes)
        self.decisions.placements.append(
            Placement(
                job_id=job.job_id, pool_id=p.id, node_gpus=node_gpus, backfilled=p.blocked_seen
            )
        )
        self._hold(job.team_id, p.gpu_type, n * g)
        return True

    def spare_fit(self, job: Pending, pool: PoolCapacity, mine: dict[int, int]):
        """The tightest of the team's own nodes in the pool (`mine`: node -> free GPUs) that
        the job may take now, as try_place scores it: ((-1, spare), [node]), or None.

        The same rules as blocked_nodes: a reserved node only if the job ends by the
        reservation's start, a node under a window only if the window allows the job."""
        g = job.gpus_per_node
        now = self.now
        end = now + job.time_limit_s
        reserved = pool.reserved
        node_windows = pool.node_windows
        best = None
        for x, f in mine.items():
            if f < g or (best is not None and (f, x) >= best):
                continue
            start = reserved.get(x)
            if start is not None and start < end:
                continue
            if x in node_windows and not pool.window_usable(x, job.team_id, now, end):
                continue
            best = (f, x)
        if best is None:
            return None
        return (-1, best[0] - g), [best[1]]

    # -- pinned jobs ---------------------------------------------------------------------------

    def pinned_pool(self, job: Pending, eligible, fitting) -> tuple[PoolCapacity] | None:
        """The pool of a pinned job's nodes, as the one pool it may try, or None when it
        cannot run there at all (a node gone, nodes in several pools, a pool it may not
        use, its quota): then it waits, and says why."""
        nodes = self.nodes_by_id
        if nodes is None:
            nodes = self.nodes_by_id = {n.id: n for n in self.snap.nodes}
        ids = sorted(job.node_ids)
        words = _pinned_words(job)
        if gone := [x for x in ids if x not in nodes]:
            self.wait(job, f"{words}: {_ids_word(gone)} gone from the fleet")
            return None
        if len(ids) != job.nodes:
            self.wait(job, f"{words}: it asks for {_nodes_word(job.nodes)}, not {len(ids)}")
            return None
        pool_ids = sorted({nodes[x].pool_id for x in ids})
        if len(pool_ids) > 1:
            listed = ", ".join(str(p) for p in pool_ids)
            self.wait(job, f"{words}: they lie in pools {listed}, and a job runs in one pool")
            return None
        pool = self.pools.get(pool_ids[0])
        if pool is None or pool not in eligible:
            self.wait(
                job,
                f"{words}: pool {pool_ids[0]} is not one it may use "
                f"(disabled, or not its GPU type or placement)",
            )
            return None
        if pool not in fitting:
            self.wait(job, self.quota_reason(job, [pool.gpu_type]))
            return None
        return (pool,)

    def place_pinned(self, job: Pending, pool: PoolCapacity) -> bool:
        """Place a pinned job on all its nodes if each may take it now, by try_place's rules
        (schedulable, gpus_per_node free to its team, no window in the way, no reservation
        of a higher job it would still run on); else it waits, naming the nodes in the way,
        and reserves its nodes from the earliest time they are all free to it."""
        g, team = job.gpus_per_node, job.team_id
        now = self.now
        end = now + job.time_limit_s
        ids = sorted(job.node_ids)
        free, owner, reserved = pool.free, pool.owner, pool.reserved
        in_way: dict[str, list[int]] = {}
        for x in ids:
            if x not in free:
                why = "not schedulable"
            elif self.nodes_by_id[x].gpus_total < g:
                why = f"with fewer than {g} GPUs"
            elif x in pool.node_windows and not pool.window_usable(x, team, now, end):
                why = "held back by a window"
            elif reserved.get(x, INFINITY) < end:
                why = "held for higher-priority jobs"
            elif x in owner and not (job.nodes == 1 and owner[x] == team):
                why = "busy (a team's jobs: one team per node)"
            elif (pool.spare.get(team, {}).get(x, 0) if x in owner else free[x]) < g:
                why = "busy"
            else:
                continue
            in_way.setdefault(why, []).append(x)
        if not in_way:
            for x in ids:
                pool.book(x, g, end, team)
            self.decisions.placements.append(
                Placement(
                    job_id=job.job_id,
                    pool_id=pool.id,
                    node_gpus=tuple((x, g) for x in ids),
                    backfilled=pool.blocked_seen,
                )
            )
            self._hold(team, pool.gpu_type, job.gpus)
            return True
        reason = f"{_pinned_words(job)}: " + ", ".join(
            f"{_ids_word(xs)} {why}" for why, xs in in_way.items()
        )
        start = self.pinned_start(job, pool, ids)
        if start is None:
            self.wait(job, reason)
        else:
            pool.reserve(ids, start, start + job.time_limit_s)
            self.wait(job, f"{reason}; earliest start {clock(start, now)} (reserved)", start)
        return False

    def pinned_start(self, job: Pending, pool: PoolCapacity, ids: list[int]) -> float | None:
        """The earliest time all of a pinned job's nodes have its GPUs free, no reservation
        on them and no window in its way; None if one of them never will (as far as this
        pass knows: not schedulable, too small, or held with no known end)."""
        g, team, limit = job.gpus_per_node, job.team_id, job.time_limit_s
        if any(x not in pool.free or self.nodes_by_id[x].gpus_total < g for x in ids):
            return None
        start = max(pool.ready_at(x, g) for x in ids)
        if start == INFINITY:
            return None
        windows = [w for x in ids for w in pool.node_windows.get(x, ())]
        # A window in the way ends at some time: the nodes stay free to the job after it.
        for t in sorted({start} | {w.end for w in windows if w.end > start}):
            if all(pool.window_usable(x, team, t, t + limit) for x in ids):
                return t
        return None

    def _hold(self, team_id: int, gpu_type: str, gpus: int) -> None:
        """The team holds (or is promised) `gpus` more GPUs of the type from now on."""
        key = (team_id, gpu_type)
        held = self.held[key] = self.held.get(key, 0) + gpus
        q = self.quotas.get(key)
        if q is not None and held > q.nominal:
            self.over_nominal.setdefault(gpu_type, set()).add(team_id)

    # -- a job that cannot start now ---------------------------------------------------------

    def blocked(self, job: Pending, pools: tuple[PoolCapacity, ...]) -> None:
        """Preempt for it, or burst for it, or reserve its earliest start; say why it waits."""
        if self.settings.preemption and self.preempt_for(job, pools):
            return
        burst_to, budget_stopped, burst_at = self.burst_target(job, pools)
        if burst_to is not None:
            spot = burst_to.info.spot and job.spot_allowed
            burst_to.burst_nodes += job.nodes
            self.decisions.bursts.append(
                BurstRequest(job_id=job.job_id, pool_id=burst_to.id, nodes=job.nodes, spot=spot)
            )
            self.wait(
                job,
                f"waiting for {_what(job)}: {_nodes_word(job.nodes)} requested from "
                f"cloud pool {burst_to.id} ({'spot' if spot else 'on-demand'})",
            )
            return
        n, g = job.nodes, job.gpus_per_node
        if budget_stopped and not any(g <= p.gpus_max and p.nodes_with[g] >= n for p in pools):
            self.wait(job, f"budget exhausted: {_what(job)} could only run on new cloud nodes")
            return
        start = where = None
        for p in pools:
            found = p.earliest_start(job)
            if found is not None and (start is None or found[0] < start[0]):
                start, where = found, p
        reason = f"waiting for {_what(job)}{' in one pool' if n > 1 else ''}: "
        reason += self.capacity_reason(job, pools)
        if budget_stopped:
            reason += "; no cloud burst: budget exhausted"
        elif burst_at is not None:
            reason += f"; cloud burst from {clock(burst_at, self.now)}"
        if start is None:
            self.wait(job, reason)
            return
        where.reserve(start[1], start[0], start[0] + job.time_limit_s)
        reason += f"; earliest start {clock(start[0], self.now)} (reserved)"
        self.wait(job, reason, start[0])

    def capacity_reason(self, job: Pending, pools) -> str:
        """Name what stands in the way: capacity, a window, reservations for higher jobs,
        or nodes with room that hold other teams' jobs."""
        g, n = job.gpus_per_node, job.nodes
        raw = usable = outside_windows = 0
        in_way: list[Window] = []
        end = self.now + job.time_limit_s
        for p in pools:
            windowed: set[int] = set()
            for w, nodes in self.windows_in_way(job, p, self.now):
                windowed |= nodes
                in_way.append(w)
            # A one-node job may also take its team's own nodes (spare_fit's rules).
            mine = [x for x, f in p.spare.get(job.team_id, {}).items() if f >= g] if n == 1 else []
            own_outside = [x for x in mine if x not in windowed]
            own_usable = sum(1 for x in own_outside if p.reserved.get(x, INFINITY) >= end)
            raw = max(raw, p.count_fitting(g) + len(mine))
            outside_windows = max(outside_windows, p.count_fitting(g, windowed) + len(own_outside))
            usable = max(usable, p.count_fitting(g, self.blocked_nodes(job, p)) + own_usable)
        if raw >= n and outside_windows < n and in_way:
            w = min(in_way, key=lambda w: (w.start, w.id))
            what = "a maintenance window" if w.team_id is None else f"team {w.team_id}'s window"
            span = f"{clock(w.start, self.now)} to {clock(w.end, self.now)}"
            return f"held back by {what} on {_nodes_word(len(w.node_ids))} ({span})"
        if outside_windows >= n and usable < n:
            return f"{_nodes_word(outside_windows)} free now, held for higher-priority jobs"
        note = self.tenancy_note(job, pools)
        if n == 1:
            return f"no node has {g} free GPUs now{note}"
        return f"{_nodes_word(usable) if usable else 'no node'} free now{note}"

    def tenancy_note(self, job: Pending, pools) -> str:
        """' (3 nodes with room hold other teams' jobs: one team per node)', or ''."""
        g = job.gpus_per_node
        if job.nodes == 1:
            count = 0
            for p in pools:
                if g <= p.gpus_max:
                    mine = p.spare.get(job.team_id, {})
                    count += p.held_cnt[g] - sum(1 for f in mine.values() if f >= g)
            whose = "other teams' jobs: one team per node"
        else:
            count = max((p.held_cnt[g] for p in pools if g <= p.gpus_max), default=0)
            whose = "a team's jobs: one team per node, and a gang waits for empty ones"
        if not count:
            return ""
        return f" ({_nodes_word(count)} with room hold{'s' if count == 1 else ''} {whose})"

    def burst_target(self, job: Pending, pools) -> tuple[PoolCapacity | None, bool, float | None]:
        """The cloud pool to ask nodes of now; whether only the budget stopped that; and
        when the job may burst if only the burst delay stands in the way."""
        if job.placement == OWNED:
            return None, False, None
        waited = self.now - job.queued_at
        burst_at = None
        for p in pools:
            info = p.info
            if not (
                p.is_cloud
                and job.gpus_per_node <= info.gpus_per_node
                and p.node_count + p.burst_nodes + job.nodes <= info.max_nodes
            ):
                continue
            if waited < info.burst_delay_s:
                at = job.queued_at + info.burst_delay_s
                burst_at = at if burst_at is None else min(burst_at, at)
            elif not job.budget_ok:
                return None, True, None
            else:
                return p, False, None
        return None, False, (burst_at if job.budget_ok else None)

    # -- preemption ------------------------------------------------------------------------------

    def preempt_for(self, job: Pending, pools) -> bool:
        """Checkpoint and stop lower jobs (or borrowers, to give a team its nominal quota
        back) so the job fits in one pool; it starts in a later pass, once they stopped."""
        best = None
        why = "priority"
        for p in pools:
            if p.victim_order and job.priority > p.victim_order[0].priority:
                found = self.victims_in(p, job, self.lower_class(job, p))
                if found is not None and (best is None or len(found[0]) < len(best[1][0])):
                    best = (p, found)
        if best is None:
            why = "reclaim"
            for p in pools:
                q = self.quotas.get((job.team_id, p.gpu_type))
                if (
                    not p.victim_order
                    or q is None
                    or self.held.get((job.team_id, p.gpu_type), 0) + job.gpus > q.nominal
                ):
                    continue
                found = self.victims_in(p, job, self.borrowers(job, p))
                if found is not None and (best is None or len(found[0]) < len(best[1][0])):
                    best = (p, found)
        if best is None:
            return False
        p, (victims, nodes) = best
        if why == "priority":
            name = CLASS_NAMES.get(job.priority, str(job.priority))
            reason = f"preempted by a higher-priority job ({name} job {job.job_id})"
        else:
            reason = (
                f"preempted: team {job.team_id} reclaims its nominal {p.gpu_type} quota "
                f"(job {job.job_id}) from borrowers"
            )
        reason += "; checkpoint, then stop"
        for r in victims:
            self.victims.add(r.job_id)
            self.decisions.preemptions.append(
                Preemption(job_id=r.job_id, for_job_id=job.job_id, reason=reason)
            )
        p.reserve(nodes, self.now, INFINITY)  # it starts once the victims have stopped
        self._hold(job.team_id, p.gpu_type, job.gpus)  # promised: the team's next jobs see it
        count = len(victims)
        self.wait(
            job,
            f"waiting for {count} preempted job{'s' if count != 1 else ''} to checkpoint and stop",
        )
        return True

    def lower_class(self, job: Pending, pool: PoolCapacity):
        """Preemptible jobs of a lower class: the lowest class first, the youngest first."""
        victims = self.victims
        for r in pool.victim_order:
            if r.priority >= job.priority:
                return
            if r.preemptible and r.job_id not in victims:
                yield r

    def borrowers(self, job: Pending, pool: PoolCapacity):
        """Preemptible jobs of other teams that hold more than their nominal quota, while
        they still would after the victims chosen before them."""
        over = self.over_nominal.get(pool.gpu_type, set()) - {job.team_id}
        if not over:
            return  # nobody else borrows this GPU type: the walk below would find no one
        held = self.held
        quotas = self.quotas
        victims = self.victims
        taken: dict[tuple[int, str], int] = {}
        for r in pool.victim_order:
            if r.team_id not in over or not r.preemptible or r.job_id in victims:
                continue
            key = (r.team_id, r.gpu_type)
            if held[key] - taken.get(key, 0) > quotas[key].nominal:
                taken[key] = taken.get(key, 0) + r.gpus
                yield r

    def victims_in(self, pool: PoolCapacity, job: Pending, candidates):
        """The fewest victims (taken in the candidates' order, then pruned) that make room
        for the job in this pool, and the nodes it would get; None if they cannot.

        A node that is not shared offers another team's job nothing until every job on it
        is a victim, and then all its GPUs; one of the job's own team's nodes offers a
        one-node job its spare GPUs plus what its victims free (a gang: as another team's).
        The choosing, the pruning and the final pick all count with `offer`.
        """
        g, n = job.gpus_per_node, job.nodes
        if g > pool.gpus_max or pool.nodes_with[g] < n or len(pool.free) < n:
            return None
        free = pool.free
        reserved = pool.reserved
        owner, holding, placed_on = pool.owner, pool.holding, pool.placed_on
        releases = pool.releases
        own_team = job.team_id if n == 1 else None  # a gang takes no team's nodes
        mine = pool.spare.get(own_team, {})
        windowed: set[int] = set()
        for _, nodes in self.windows_in_way(job, pool, self.now):
            windowed |= nodes
        blocked_free = windowed | pool.reserved_free

        def usable(x):
            return x in free and x not in reserved and x not in windowed

        def offer(x, freed: int, stopped: int) -> int:
            """What node x has for the job once victims holding `freed` of its GPUs, and
            `stopped` of its jobs, have stopped."""
            if x not in owner:
                return free[x] + freed  # shared, or holding nothing
            if own_team is not None and owner[x] == own_team:
                return mine.get(x, 0) + freed
            if x in placed_on or stopped < len(holding[x]):
                return 0  # this pass's jobs on it are no victims
            return releases[x][0][1]  # the whole node

        cnt = pool.count_fitting(g, blocked_free)
        cnt += sum(1 for x, f in mine.items() if f >= g and usable(x))
        extra: dict[int, int] = {}
        gone: dict[int, int] = {}  # node -> how many of its jobs are victims
        chosen: list[Running] = []
        for r in candidates:
            touched = False
            for x, gp in r.node_gpus:
                if usable(x):
                    e, k = extra.get(x, 0), gone.get(x, 0)
                    old = offer(x, e, k)
                    extra[x], gone[x] = e + gp, k + 1
                    if old < g <= offer(x, e + gp, k + 1):
                        cnt += 1
                    touched = True
            if touched:
                chosen.append(r)
                if cnt >= n:
                    break
        else:
            return None
        if not chosen:
            return None  # it fits without anyone stopping: nothing to preempt for
        # Drop the victims the others make unnecessary, the last chosen first.
        for r in list(reversed(chosen)):
            loss = 0
            for x, gp in r.node_gpus:
                if usable(x):
                    e, k = extra[x], gone[x]
                    if offer(x, e, k) >= g > offer(x, e - gp, k - 1):
                        loss += 1
            if cnt - loss >= n:
                cnt -= loss
                chosen.remove(r)
                for x, gp in r.node_gpus:
                    if usable(x):
                        extra[x] -= gp
                        gone[x] -= 1
        rack_of = pool.rack_of
        rack_nodes = pool.rack_nodes
        free_now = {
            x
            for racks in pool.bucket[g][1:]  # racks with at least one node of g free GPUs
            for r in racks
            for x in rack_nodes[r]
            if free[x] >= g and usable(x)
        }
        free_now.update(x for x, f in mine.items() if f >= g and usable(x))
        fits = [
            (0 if extra.get(x) else 1, rack_of[x], x)
            for x in set(extra) | free_now
            if offer(x, extra.get(x, 0), gone.get(x, 0)) >= g
        ]
        fits.sort()
        chosen.sort(key=lambda r: r.job_id)
        return chosen, [x for _, _, x in fits[:n]]
