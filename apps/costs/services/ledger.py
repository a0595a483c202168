"""Metering into the ledger, corrections and roll-ups.

Metering is a service the periodic task calls with a reader of the jobs' allocations (costs
sits below jobs, so it is handed the data, never reads it itself).
"""

import datetime as dt
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.accounts.services import (
    audit_record,
    snapshot,
)
from apps.costs import metering, pricing, selectors
from apps.costs.models import (
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    UsageEntry,
    UsageKind,
)
from apps.costs.money import NANOS, ZERO, from_nanos, to_nanos
from apps.costs.services.access import _require_finance
from apps.fleet import selectors as fleet
from controlplane.bulk import insert_rows, update_rows
from controlplane.errors import ApplicationError


@dataclass(frozen=True)
class Held:
    """An allocation as the metering task reads it from jobs (plain data)."""

    node_id: int
    job_id: int
    team_id: int
    gpus: int
    started_at: dt.datetime
    ended_at: dt.datetime | None


# (node ids, since, until) -> the allocations of those nodes overlapping [since, until)
AllocationsReader = Callable[..., Iterable[Held]]


@dataclass
class MeterReport:
    until: dt.datetime | None = None
    nodes: int = 0
    rows: int = 0
    corrections: int = 0
    amount: Decimal = ZERO
    batches: int = 0


ENTRY_FIELDS = (
    "node",
    "pool",
    "instance_type",
    "team",
    "job",
    "kind",
    "capacity_type",
    "gpus",
    "node_gpus",
    "start",
    "end",
    "day",
    "rate_per_hour",
    "amount",
    "savings",
    "power_w",
    "price_ref",
    "corrects",
    "note",
    "recorded_at",
)
MONEY_POSITIONS = tuple(ENTRY_FIELDS.index(name) for name in ("rate_per_hour", "amount", "savings"))


def _insert_entries(rows: list[tuple]) -> int:
    """Ledger rows with money as nano-units: COPY takes them as integers, the ORM as Decimal."""
    if connection.vendor != "postgresql":
        rows = [
            tuple(from_nanos(v) if i in MONEY_POSITIONS else v for i, v in enumerate(row))
            for row in rows
        ]
    return insert_rows(UsageEntry, ENTRY_FIELDS, rows)


@dataclass
class _Sums:
    """Roll-up deltas of one metering transaction, keyed as the roll-up tables are."""

    daily: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    monthly: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    jobs: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))

    def add(self, *, day, team_id, pool_id, capacity, type_id, job_id, amount, savings, gpu_s):
        for cell in (
            self.daily[(day, team_id or 0, pool_id, capacity, type_id or 0)],
            self.monthly[(day.replace(day=1), team_id or 0, pool_id, capacity, type_id or 0)],
        ):
            cell[0] += amount
            cell[1] += savings
            cell[2] += gpu_s
        if job_id is not None:
            job = self.jobs[(job_id, day)]
            job[0] = team_id or 0
            job[1] += amount
            job[2] += gpu_s


def _upsert(table: str, keys: tuple, columns: tuple, rows: list[tuple], *, kept=()) -> None:
    """INSERT … ON CONFLICT DO UPDATE adding the new values to the stored ones (PostgreSQL
    and SQLite both speak it). Rows are (*keys, *kept, *columns): `kept` columns are set
    by the insert and left alone by the update."""
    if not rows:
        return
    names = keys + tuple(kept) + columns
    adds = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in columns)
    sql = (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(['%s'] * len(names))}) "  # noqa: S608
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {adds}"
    )
    with connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def _rollups_add(sums: _Sums) -> None:
    """Add a transaction's rows to the daily roll-ups, in the same transaction."""
    _upsert(
        DailySpend._meta.db_table,
        ("day", "team_id", "pool_id", "capacity_type", "instance_type_id"),
        ("amount", "savings", "gpu_seconds"),
        [(*key, *values) for key, values in sums.daily.items()],
    )
    _upsert(
        MonthlySpend._meta.db_table,
        ("month", "team_id", "pool_id", "capacity_type", "instance_type_id"),
        ("amount", "savings", "gpu_seconds"),
        [(*key, *values) for key, values in sums.monthly.items()],
    )
    _upsert(
        JobDailySpend._meta.db_table,
        ("job_id", "day"),
        ("amount", "gpu_seconds"),
        [(*key, *values) for key, values in sums.jobs.items()],
        kept=("team_id",),
    )


def _entry_row(
    node: selectors.NodeRow, piece: metering.Piece, nanos: int, *, now, **extra
) -> tuple:
    values = {
        "node": node.id,
        "pool": node.pool_id,
        "instance_type": node.instance_type_id,
        "team": piece.team_id,
        "job": piece.job_id,
        "kind": UsageKind.JOB if piece.job_id is not None else UsageKind.IDLE,
        "capacity_type": node.capacity_type,
        "gpus": piece.gpus,
        "node_gpus": piece.node_gpus,
        "start": piece.start,
        "end": piece.end,
        "day": piece.day,
        "rate_per_hour": to_nanos(piece.rate.per_hour),
        "amount": nanos,
        "savings": round(piece.exact_savings * NANOS),
        "power_w": piece.rate.power_w,
        "price_ref": piece.rate.ref[:60],
        "corrects": None,
        "note": "",
        "recorded_at": now,
    }
    values.update(extra)
    return tuple(values[name] for name in ENTRY_FIELDS)


def _piece_of(entry: UsageEntry, rate: pricing.Rate) -> metering.Piece:
    """A booked row's time and holders as a piece, for a correction row to repeat."""
    return metering.Piece(
        job_id=entry.job_id,
        team_id=entry.team_id,
        gpus=entry.gpus,
        node_gpus=entry.node_gpus,
        start=entry.start,
        end=entry.end,
        day=entry.day,
        rate=rate,
        exact=Fraction(0),
        exact_savings=Fraction(0),
    )


def _sum_entry(sums: _Sums, row: tuple) -> None:
    get = dict(zip(ENTRY_FIELDS, row, strict=True))
    seconds = metering.seconds_between(get["start"], get["end"])
    gpu_seconds = round(seconds * (get["gpus"] or 0)) if get["corrects"] is None else 0
    sums.add(
        day=get["day"],
        team_id=get["team"],
        pool_id=get["pool"],
        capacity=get["capacity_type"],
        type_id=get["instance_type"],
        job_id=get["job"],
        amount=get["amount"],
        savings=get["savings"],
        gpu_s=gpu_seconds,
    )


def usage_meter(
    *,
    allocations_for: AllocationsReader,
    until: dt.datetime | None = None,
    batch_size: int = 500,
) -> MeterReport:
    """Meter every node from its high-water mark up to `until` (now less COSTS_METER_LAG_S,
    so allocations being written are in). One transaction per batch of nodes writes the
    rows, the roll-ups and the marks together: a run killed half-way leaves each node
    either metered to `until` or untouched, and the next run carries on from there."""
    now = timezone.now()
    until = until or now - dt.timedelta(seconds=settings.COSTS_METER_LAG_S)
    report = MeterReport(until=until)
    finished = set(
        MeterMark.objects.filter(closed=True, reprice_from__isnull=True).values_list(
            "node_id", flat=True
        )
    )
    node_ids = [n for n in fleet.node_ids() if n not in finished]
    for start in range(0, len(node_ids), batch_size):
        _meter_batch(node_ids[start : start + batch_size], until, allocations_for, report, now)
        report.batches += 1
    if report.rows or report.corrections:
        selectors.forget_budget_state()
    return report


@transaction.atomic
def _meter_batch(node_ids, until, allocations_for, report: MeterReport, now) -> None:
    tz = selectors.time_zone()
    marks = {
        m.node_id: m for m in MeterMark.objects.select_for_update().filter(node_id__in=node_ids)
    }
    nodes = selectors.node_rows(node_ids)
    since: dict[int, dt.datetime] = {}
    for node_id, node in nodes.items():
        mark = marks.get(node_id)
        start = mark.metered_until if mark is not None else node.billable_from
        if start is not None:
            since[node_id] = start
    to_reprice = {
        node_id: mark.reprice_from
        for node_id, mark in marks.items()
        if mark.reprice_from is not None and node_id in nodes
    }
    if not since:
        return
    # Rows being repriced may start up to a day before their node's `reprice_from` (rows
    # never cross a local midnight): the prices in force from there on are needed.
    earliest = min([*since.values(), *(t - dt.timedelta(days=2) for t in to_reprice.values())])
    prices = selectors.PriceBook.read([nodes[n] for n in since], since=earliest, until=until)
    holdings: dict[int, list[metering.Holding]] = defaultdict(list)
    for held in allocations_for(node_ids=list(since), since=min(since.values()), until=until):
        holdings[held.node_id].append(
            metering.Holding(
                job_id=held.job_id,
                team_id=held.team_id,
                gpus=held.gpus,
                start=held.started_at,
                end=held.ended_at,
            )
        )

    sums = _Sums()
    rows: list[tuple] = []
    corrections = _reprice(nodes, to_reprice, prices, now=now) if to_reprice else []
    new_marks, changed_marks = [], []
    for node_id, start in since.items():
        node = nodes[node_id]
        mark = marks.get(node_id)
        if mark is not None:
            mark.reprice_from = None
        closed = node.billable_until is not None and until >= node.billable_until
        if start >= until:
            if mark is not None and (closed != mark.closed or node_id in to_reprice):
                mark.closed = closed
                changed_marks.append(mark)
            continue
        pieces = metering.pieces_for(
            node.facts,
            since=start,
            until=until,
            holdings=holdings.get(node_id, ()),
            timeline=prices.timeline(node, node.power_w),
            tz=tz,
        )
        carry = Fraction(mark.carry) if mark is not None else Fraction(0)
        booked, carry = metering.book(pieces, carry)
        rows.extend(
            _entry_row(node, piece, nanos, now=now)
            for piece, nanos in zip(pieces, booked, strict=True)
        )
        if mark is None:
            new_marks.append(
                MeterMark(node_id=node_id, metered_until=until, carry=str(carry), closed=closed)
            )
        else:
            mark.metered_until, mark.carry, mark.closed = until, str(carry), closed
            changed_marks.append(mark)
        report.nodes += 1
    everything = rows + corrections
    for row in everything:
        _sum_entry(sums, row)
    _insert_entries(everything)
    _rollups_add(sums)
    MeterMark.objects.bulk_create(new_marks)
    _marks_save(changed_marks)
    report.rows += len(rows)
    report.corrections += len(corrections)
    report.amount += from_nanos(sum(row[ENTRY_FIELDS.index("amount")] for row in everything))


MARK_FIELDS = ("metered_until", "carry", "closed", "reprice_from")


def _marks_save(marks: list[MeterMark]) -> None:
    """One UPDATE from arrays on PostgreSQL (Django's bulk_update builds a CASE per row)."""
    if not marks:
        return
    if connection.vendor != "postgresql":
        MeterMark.objects.bulk_update(marks, list(MARK_FIELDS), batch_size=500)
        return
    update_rows(
        MeterMark,
        MARK_FIELDS,
        [(m.node_id, *(getattr(m, f) for f in MARK_FIELDS)) for m in marks],
        keys=("node",),
    )


def _reprice(nodes, to_reprice, prices: selectors.PriceBook, *, now) -> list[tuple]:
    """Correction rows for what these nodes booked since their `reprice_from`, priced
    again with the price book as it stands: new rows for the differences, nothing edited."""
    earliest = min(to_reprice.values())
    booked: dict[int, list] = defaultdict(list)
    for entry in UsageEntry.objects.filter(node_id__in=list(to_reprice), end__gt=earliest).order_by(
        "start", "id"
    ):
        booked[entry.node_id].append(entry)
    rows = []
    for node_id, since in to_reprice.items():
        node = nodes.get(node_id)
        if node is None:
            continue
        originals: dict[int, UsageEntry] = {}
        totals: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for entry in booked.get(node_id, []):
            original_id = entry.corrects_id or entry.pk
            if entry.corrects_id is None:
                if entry.end <= since:
                    continue
                originals[entry.pk] = entry
            totals[original_id][0] += to_nanos(entry.amount)
            totals[original_id][1] += to_nanos(entry.savings)
        timelines: dict = {}
        for original in originals.values():
            power = original.power_w
            if power not in timelines:
                timelines[power] = prices.timeline(node, power)
            timeline = timelines[power]
            amount, saving, rate = _priced_again(original, timeline)
            delta = round(amount * NANOS) - totals[original.pk][0]
            delta_savings = round(saving * NANOS) - totals[original.pk][1]
            if not delta and not delta_savings:
                continue
            rows.append(
                _entry_row(
                    node,
                    _piece_of(original, rate),
                    delta,
                    now=now,
                    capacity_type=original.capacity_type,
                    pool=original.pool_id,
                    instance_type=original.instance_type_id,
                    savings=delta_savings,
                    power_w=original.power_w,
                    corrects=original.pk,
                    note=f"repriced: the price book changed from {since:%Y-%m-%d %H:%M} UTC",
                )
            )
    return rows


def _priced_again(entry: UsageEntry, timeline) -> tuple[Fraction, Fraction, pricing.Rate]:
    """An entry's exact amount and savings under `timeline`, and the rate at its start."""
    cuts = sorted(
        {entry.start, entry.end} | {t for t, _ in timeline if entry.start < t < entry.end}
    )
    weight = Fraction(entry.gpus or entry.node_gpus, entry.node_gpus or 1)
    amount = saving = Fraction(0)
    for start, end in itertools.pairwise(cuts):
        rate = pricing.value_at(timeline, start, pricing.UNPRICED)
        hours = metering.seconds_between(start, end) / metering.SECONDS_PER_HOUR
        amount += Fraction(rate.per_hour) * hours * weight
        if rate.on_demand is not None:
            saving += Fraction(rate.on_demand - rate.per_hour) * hours * weight
    return amount, saving, pricing.value_at(timeline, entry.start, pricing.UNPRICED)


@transaction.atomic
def usage_correct(*, entry: UsageEntry, amount: Decimal, note: str, by) -> UsageEntry:
    """Finance's correction of a ledger row: a new row adding `amount` (negative to take
    away), never an edit of the row itself."""
    _require_finance(by)
    if not note.strip():
        raise ApplicationError("Say why.", details={"note": ["A correction needs a reason."]})
    original = UsageEntry.objects.get(pk=entry.corrects_id or entry.pk)
    node = selectors.NodeRow(
        id=original.node_id,
        pool_id=original.pool_id,
        instance_type_id=original.instance_type_id,
        capacity_type=original.capacity_type,
        gpus=original.node_gpus,
        billable_from=None,
        billable_until=None,
        power_w=original.power_w,
        region="",
    )
    row = _entry_row(
        node,
        _piece_of(original, pricing.Rate(per_hour=original.rate_per_hour, ref=original.price_ref)),
        to_nanos(amount),
        now=timezone.now(),
        savings=0,
        power_w=original.power_w,
        corrects=original.pk,
        note=note.strip()[:200],
    )
    sums = _Sums()
    _sum_entry(sums, row)
    _insert_entries([row])
    _rollups_add(sums)
    correction = UsageEntry.objects.filter(corrects_id=original.pk).order_by("-id").first()
    audit_record(actor=by, action="usage.correct", obj=correction, after=snapshot(correction))
    selectors.forget_budget_state()
    return correction


def rollups_rebuild(*, since: dt.date | None = None) -> int:
    """Rebuild the daily and monthly roll-ups from the ledger (from `since` on, or all of it).

    The roll-ups are derived: metering keeps them in step row by row; this is for ops
    after a restore, and for loading a ledger in bulk (the benchmark).
    """
    daily, jobs = DailySpend._meta.db_table, JobDailySpend._meta.db_table
    ledger = UsageEntry._meta.db_table
    where, params = ("WHERE day >= %s", [since]) if since else ("", [])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {daily} {where}", params)  # noqa: S608
        cursor.execute(f"DELETE FROM {jobs} {where}", params)  # noqa: S608
        seconds = (
            'EXTRACT(EPOCH FROM ("end" - start))'
            if connection.vendor == "postgresql"
            else '((julianday("end") - julianday(start)) * 86400.0)'
        )
        gpu_seconds = (
            f"CAST(ROUND(SUM(CASE WHEN corrects_id IS NULL THEN gpus * {seconds} ELSE 0 END)) "
            "AS BIGINT)"
        )
        cursor.execute(
            f"INSERT INTO {daily} (day, team_id, pool_id, capacity_type, instance_type_id, "  # noqa: S608
            f"amount, savings, gpu_seconds) SELECT day, COALESCE(team_id, 0), pool_id, "
            f"capacity_type, COALESCE(instance_type_id, 0), SUM(amount), SUM(savings), "
            f"{gpu_seconds} FROM {ledger} {where} "
            "GROUP BY day, COALESCE(team_id, 0), pool_id, capacity_type, "
            "COALESCE(instance_type_id, 0)",
            params,
        )
        job_where = f"{where} AND job_id IS NOT NULL" if where else "WHERE job_id IS NOT NULL"
        cursor.execute(
            f"INSERT INTO {jobs} (job_id, day, team_id, amount, gpu_seconds) "  # noqa: S608
            f"SELECT job_id, day, MAX(COALESCE(team_id, 0)), SUM(amount), {gpu_seconds} "
            f"FROM {ledger} {job_where} GROUP BY job_id, day",
            params,
        )
        # Months from the days (from the first month `since` touches, whole).
        monthly = MonthlySpend._meta.db_table
        month_of = (
            "CAST(date_trunc('month', day) AS date)"
            if connection.vendor == "postgresql"
            else "date(day, 'start of month')"
        )
        first = [since.replace(day=1)] if since else []
        month_where = "WHERE day >= %s" if since else ""
        cursor.execute(
            f"DELETE FROM {monthly} {'WHERE month >= %s' if since else ''}",  # noqa: S608
            first,
        )
        cursor.execute(
            f"INSERT INTO {monthly} (month, team_id, pool_id, capacity_type, instance_type_id, "  # noqa: S608
            f"amount, savings, gpu_seconds) SELECT {month_of}, team_id, pool_id, capacity_type, "
            f"instance_type_id, SUM(amount), SUM(savings), SUM(gpu_seconds) FROM {daily} "
            f"{month_where} GROUP BY {month_of}, team_id, pool_id, capacity_type, "
            "instance_type_id",
            first,
        )
        cursor.execute(f"SELECT COUNT(*) FROM {daily}")  # noqa: S608
        count = cursor.fetchone()[0]
    selectors.forget_budget_state()
    return count
