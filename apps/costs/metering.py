"""Cutting a node's time into ledger pieces: pure functions over plain data (no ORM).

A node costs from `billable_from` (owned: when it was registered; cloud: when its
instance launched) until `billable_until` (when it was terminated), whatever its state.
Over a window, its time is cut wherever something changes: a job's allocation starts
or ends, the rate steps, or a day ends in COSTS_TIME_ZONE. Each piece's cost goes to
the jobs holding GPUs in proportion to the GPUs they hold; GPUs nobody holds are idle:

    piece cost  = rate per node-hour × hours
    job's share = piece cost × job's GPUs / node's GPUs
    idle        = piece cost × idle GPUs / node's GPUs

so a node's job shares and idle add up to its whole cost. Amounts are exact (Fraction)
until booked: each node books them in nano-units with a carried remainder, so the rows
of a node add up to its exact cost rounded once.
"""

import dataclasses
import datetime as dt
import itertools
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from apps.costs.money import NANOS
from apps.costs.pricing import UNPRICED, Rate, Timeline, value_at

SECONDS_PER_HOUR = 3600


@dataclass(frozen=True)
class NodeFacts:
    node_id: int
    pool_id: int
    instance_type_id: int | None
    capacity_type: str
    gpus: int
    billable_from: dt.datetime | None
    billable_until: dt.datetime | None = None


@dataclass(frozen=True)
class Holding:
    """GPUs of the node held by a job over [start, end) (end None: still held)."""

    job_id: int
    team_id: int
    gpus: int
    start: dt.datetime
    end: dt.datetime | None = None


@dataclass(frozen=True)
class Piece:
    job_id: int | None  # None: idle
    team_id: int | None
    gpus: int
    node_gpus: int
    start: dt.datetime
    end: dt.datetime
    day: dt.date
    rate: Rate
    exact: Fraction  # the amount, exactly
    exact_savings: Fraction

    @property
    def seconds(self) -> Fraction:
        return seconds_between(self.start, self.end)


def seconds_between(start: dt.datetime, end: dt.datetime) -> Fraction:
    delta = end - start
    return Fraction(
        (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds, 1_000_000
    )


def local_midnights(start: dt.datetime, end: dt.datetime, tz: zoneinfo.ZoneInfo):
    """Every midnight in `tz` strictly between start and end."""
    day = start.astimezone(tz).date() + dt.timedelta(days=1)
    while True:
        midnight = dt.datetime.combine(day, dt.time(0), tzinfo=tz)
        if midnight >= end:
            return
        if midnight > start:
            yield midnight.astimezone(dt.UTC)
        day += dt.timedelta(days=1)


def pieces_for(
    node: NodeFacts,
    *,
    since: dt.datetime,
    until: dt.datetime,
    holdings: Iterable[Holding],
    timeline: Timeline,
    tz: zoneinfo.ZoneInfo,
) -> list[Piece]:
    """The node's billable time in [since, until), cut and attributed (see the module)."""
    if node.billable_from is None:
        return []
    low = max(since, node.billable_from)
    high = until if node.billable_until is None else min(until, node.billable_until)
    if low >= high:
        return []
    held = [h for h in holdings if h.gpus > 0 and h.start < high and (h.end is None or h.end > low)]
    cuts = {low, high}
    cuts.update(h.start for h in held if low < h.start < high)
    cuts.update(h.end for h in held if h.end is not None and low < h.end < high)
    cuts.update(t for t, _ in timeline if low < t < high)
    cuts.update(local_midnights(low, high, tz))
    moments = sorted(cuts)

    pieces: list[Piece] = []
    last: dict[int | None, int] = {}  # the index of each job's last piece, to extend it
    for start, end in itertools.pairwise(moments):
        rate = value_at(timeline, start, UNPRICED)
        by_job: dict[int, tuple[int, int]] = {}
        for h in held:
            if h.start <= start and (h.end is None or h.end >= end):
                team, gpus = by_job.get(h.job_id, (h.team_id, 0))
                by_job[h.job_id] = (team, gpus + h.gpus)
        holding_gpus = sum(g for _, g in by_job.values())
        split_over = max(node.gpus, holding_gpus)
        node_cost = Fraction(rate.per_hour) * seconds_between(start, end) / SECONDS_PER_HOUR
        saving = (
            Fraction(rate.on_demand - rate.per_hour)
            * seconds_between(start, end)
            / SECONDS_PER_HOUR
            if rate.on_demand is not None
            else Fraction(0)
        )
        day = start.astimezone(tz).date()
        shares = [(job_id, team, gpus) for job_id, (team, gpus) in sorted(by_job.items())]
        if split_over == 0:  # a node without GPUs: its cost is all idle
            shares, split_over = [(None, None, 0)], 1
            idle = 0
        else:
            idle = split_over - holding_gpus
        if idle:
            shares.append((None, None, idle))
        for job_id, team, gpus in shares:
            weight = Fraction(gpus or split_over, split_over)
            piece = Piece(
                job_id=job_id,
                team_id=team,
                gpus=gpus,
                node_gpus=split_over,
                start=start,
                end=end,
                day=day,
                rate=rate,
                exact=node_cost * weight,
                exact_savings=saving * weight,
            )
            before = pieces[last[job_id]] if job_id in last else None
            if (
                before is not None
                and before.end == start
                and (before.gpus, before.node_gpus, before.rate, before.day, before.team_id)
                == (gpus, split_over, rate, day, team)
            ):
                piece = dataclasses.replace(
                    piece,
                    start=before.start,
                    exact=before.exact + piece.exact,
                    exact_savings=before.exact_savings + piece.exact_savings,
                )
                pieces[last[job_id]] = piece
            else:
                last[job_id] = len(pieces)
                pieces.append(piece)
    return pieces


def book(pieces: Sequence[Piece], carry: Fraction) -> tuple[list[int], Fraction]:
    """Each piece's amount in whole nano-units, carrying the remainder from piece to piece
    (and from run to run), so a node's booked total never drifts from its exact cost."""
    booked = []
    for piece in pieces:
        wanted = carry + piece.exact * NANOS
        nanos = round(wanted)
        carry = wanted - nanos
        booked.append(nanos)
    return booked, carry
