"""Queue order: priority class first, then Slurm's classic fair-share factor and age."""

from itertools import compress, islice
from operator import eq

from apps.jobs.scheduler.snapshot import Pending, PlanSettings, Snapshot


def fair_share_factors(
    *, usage: dict[int, float], shares: dict[int, float], teams: set[int]
) -> dict[int, float]:
    """Slurm's classic factor F = 2^(-U/S) for each team in `teams`.

    U is the team's share of all decayed usage (0 when nobody has used anything), S its
    share weight over the weights of the teams present (a missing weight counts as 1).
    A team that has used nothing gets 1; one that used twice its share gets 1/4.
    """
    total_usage = sum(usage.values())
    weights = {team: shares.get(team, 1.0) for team in teams}
    total_weight = sum(w for w in weights.values() if w > 0)
    factors = {}
    for team, weight in weights.items():
        used = usage.get(team, 0.0) / total_usage if total_usage > 0 else 0.0
        if used <= 0:
            factors[team] = 1.0
        elif weight <= 0 or total_weight <= 0:
            factors[team] = 0.0  # no share at all: behind every team that has one
        else:
            factors[team] = 2.0 ** (-used / (weight / total_weight))
    return factors


def priority_scores(snapshot: Snapshot) -> dict[int, float]:
    """Job id -> the score that orders jobs within one priority class (higher goes first)."""
    return {
        j.job_id: -neg for j, neg in zip(snapshot.pending, _negated_scores(snapshot), strict=True)
    }


def queue_order(snapshot: Snapshot) -> list[Pending]:
    """Pending jobs, highest first: class, then score, then the longest waiting, then job id."""
    pending = snapshot.pending
    neg = _negated_scores(snapshot)
    rank = [-j.priority for j in pending]
    # Two sorts on plain float and int keys (stable: by class, then by score) run several
    # times faster than one sort on tuples.
    order = sorted(range(len(pending)), key=neg.__getitem__)
    order.sort(key=rank.__getitem__)
    _break_ties(order, neg, rank, pending)
    return list(map(pending.__getitem__, order))


def _break_ties(order: list[int], neg: list[float], rank: list[int], pending) -> None:
    """Within runs of one class and an equal score: the one queued first, then job id.

    The places where a score equals the next one are found by C loops (map, compress);
    Python then walks only those, not the whole queue (a few thousand of 50,000)."""
    scores = list(map(neg.__getitem__, order))
    end = len(order)
    done = -1  # the last position of the last run put in order
    for k in compress(range(end - 1), map(eq, scores, islice(scores, 1, None))):
        if k <= done:
            continue
        m = k + 1
        while m < end and scores[m] == scores[k] and rank[order[m]] == rank[order[k]]:
            m += 1
        if m - k > 1:
            order[k:m] = sorted(order[k:m], key=lambda i: (pending[i].queued_at, pending[i].job_id))
        done = m - 1


def _negated_scores(snapshot: Snapshot) -> list[float]:
    """-(fair_share_weight × F + age_weight × min(age / max_age_s, 1)) per pending job."""
    settings: PlanSettings = snapshot.settings
    teams = {job.team_id for job in snapshot.pending}
    teams.update(r.team_id for r in snapshot.running)
    factors = fair_share_factors(usage=snapshot.usage, shares=snapshot.shares, teams=teams)
    fair = {team: settings.fair_share_weight * f for team, f in factors.items()}
    now = snapshot.now
    cap = settings.age_weight
    if settings.max_age_s <= 0:
        return [-fair[j.team_id] - cap for j in snapshot.pending]
    max_age = settings.max_age_s
    return [
        -fair[j.team_id]
        - (cap * (a if a < 1.0 else 1.0) if (a := (now - j.queued_at) / max_age) > 0 else 0.0)
        for j in snapshot.pending
    ]
