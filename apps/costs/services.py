"""Writes for costs: the price book, metering into the ledger, roll-ups, budgets and alerts.

Only finance (and superusers) change the price book; finance and a team's admins set
its budget. Metering is a service the periodic task calls with a reader of the jobs'
allocations (costs sits below jobs, so it is handed the data, never reads it itself).
"""

import datetime as dt
import itertools
import logging
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.models import Membership, Team, TeamRole
from apps.accounts.secrets import decrypt, encrypt
from apps.accounts.selectors import roles_of
from apps.accounts.services import (
    audit_record,
    audited_create,
    audited_delete,
    audited_update,
    snapshot,
)
from apps.costs import metering, pricing, selectors
from apps.costs.models import (
    Budget,
    BudgetAlert,
    CloudPrice,
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
    UsageKind,
    WebhookState,
)
from apps.costs.money import NANOS, ZERO, from_nanos, money_text, to_nanos
from apps.fleet.models import InstanceType, Node, PoolKind
from apps.fleet.models.nodes import CapacityType
from controlplane import webhooks
from controlplane.bulk import insert_rows, update_rows
from controlplane.celery import enqueue_on_commit
from controlplane.errors import ApplicationError

log = logging.getLogger(__name__)


def _deny(message: str) -> ApplicationError:
    return ApplicationError(message, code="permission_denied", status=403)


def _require_finance(by) -> None:
    roles = roles_of(by) if by is not None else None
    if roles is not None and not (roles.superuser or roles.finance):
        raise _deny("Only finance edits the price book.")


def _require_budget_setter(by, team: Team) -> None:
    roles = roles_of(by) if by is not None else None
    if roles is not None and not (roles.superuser or roles.finance or roles.is_team_admin(team.pk)):
        raise _deny(f"Only finance and admins of {team.slug} set its budget.")


def _by(by):
    return by if by is not None and by.pk else None


# --- the price book ------------------------------------------------------------------------


def _nodes_priced_by(price) -> Q:
    """The nodes whose rate a price-book row sets."""
    if isinstance(price, OwnedPrice):
        return Q(pool_id=price.pool_id, capacity_type=CapacityType.OWNED)
    if isinstance(price, PoolDiscount):
        return Q(pool_id=price.pool_id) & ~Q(capacity_type=CapacityType.OWNED)
    return Q(instance_type_id=price.instance_type_id, pool__region=price.region) & ~Q(
        capacity_type=CapacityType.OWNED
    )


def _reprice_after(nodes: Q, since: dt.datetime) -> int:
    """Ask the next metering run to correct what these nodes booked since `since`."""
    marks = MeterMark.objects.filter(
        node_id__in=Node.objects.filter(nodes).values("id"), metered_until__gt=since
    ).filter(Q(reprice_from__isnull=True) | Q(reprice_from__gt=since))
    return marks.update(reprice_from=since)


EARLIEST_PRICE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
LATEST_PRICE = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)


def _check_price(model, fields: dict) -> None:
    effective = fields.get("effective_from")
    if effective is not None and not (EARLIEST_PRICE <= effective < LATEST_PRICE):
        raise ApplicationError(
            "A price takes effect between 2000 and 2100.",
            details={"effective_from": ["Between 2000-01-01 and 2100-01-01."]},
        )
    if model is OwnedPrice:
        pool = fields.get("pool")
        if pool is not None and pool.kind != PoolKind.OWNED:
            raise ApplicationError(
                "Owned prices are for owned pools.", details={"pool": ["Not an owned pool."]}
            )
    if model is PoolDiscount:
        pool = fields.get("pool")
        if pool is not None and pool.kind != PoolKind.CLOUD:
            raise ApplicationError(
                "Discounts apply to cloud pools.", details={"pool": ["Not a cloud pool."]}
            )


@transaction.atomic
def price_create(*, model, by, **fields):
    """Add a row to the price book (OwnedPrice, CloudPrice or PoolDiscount)."""
    _require_finance(by)
    _check_price(model, fields)
    fields["created_by"] = _by(by)
    price = audited_create(
        model=model, by=by, fields=fields, action=f"{model._meta.model_name}.create"
    )
    _reprice_after(_nodes_priced_by(price), price.effective_from)
    selectors.forget_budget_state()
    return price


@transaction.atomic
def price_update(*, price, by, **changes):
    _require_finance(by)
    _check_price(type(price), {"pool": getattr(price, "pool", None), **changes})
    before = type(price).objects.get(pk=price.pk)
    saved = audited_update(
        instance=price, by=by, changes=changes, action=f"{price._meta.model_name}.update"
    )
    since = min(before.effective_from, saved.effective_from)
    _reprice_after(_nodes_priced_by(before) | _nodes_priced_by(saved), since)
    return saved


@transaction.atomic
def price_delete(*, price, by) -> None:
    _require_finance(by)
    _reprice_after(_nodes_priced_by(price), price.effective_from)
    audited_delete(instance=price, by=by, action=f"{price._meta.model_name}.delete")


def owned_price_create(*, by, **fields) -> OwnedPrice:
    return price_create(model=OwnedPrice, by=by, **fields)


def cloud_price_create(*, by, **fields) -> CloudPrice:
    return price_create(model=CloudPrice, by=by, **fields)


def pool_discount_create(*, by, **fields) -> PoolDiscount:
    return price_create(model=PoolDiscount, by=by, **fields)


@dataclass(frozen=True)
class SpotQuote:
    """One entry of describe_spot_price_history (workers/providers/aws.py's SpotPrice)."""

    availability_zone: str
    instance_type: str
    per_hour: Decimal
    effective_at: dt.datetime


@transaction.atomic
def spot_prices_record(*, region: str, quotes: Iterable[SpotQuote]) -> int:
    """Store spot prices with their effective times (known ones are skipped); where a new
    one takes effect behind what was metered, the next metering run corrects it."""
    types = dict(InstanceType.objects.values_list("name", "id"))
    rows = {
        (types[q.instance_type], q.availability_zone, q.effective_at): q
        for q in quotes
        if q.instance_type in types
    }
    if not rows:
        return 0
    known = set(
        SpotPrice.objects.filter(
            instance_type_id__in={k[0] for k in rows},
            effective_at__gte=min(k[2] for k in rows),
        ).values_list("instance_type_id", "availability_zone", "effective_at")
    )
    new = [
        SpotPrice(
            instance_type_id=type_id,
            region=region,
            availability_zone=zone,
            effective_at=at,
            per_hour=quote.per_hour,
        )
        for (type_id, zone, at), quote in rows.items()
        if (type_id, zone, at) not in known
    ]
    SpotPrice.objects.bulk_create(new, ignore_conflicts=True, batch_size=500)
    earliest: dict[int, dt.datetime] = {}
    for price in new:
        earliest[price.instance_type_id] = min(
            earliest.get(price.instance_type_id, price.effective_at), price.effective_at
        )
    for type_id, since in earliest.items():
        _reprice_after(
            Q(instance_type_id=type_id, pool__region=region, capacity_type=CapacityType.SPOT),
            since,
        )
    return len(new)


# --- metering ------------------------------------------------------------------------------


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
    finished = MeterMark.objects.filter(closed=True, reprice_from__isnull=True).values("node_id")
    node_ids = list(
        Node.objects.exclude(pk__in=finished).order_by("id").values_list("id", flat=True)
    )
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


# --- budgets -------------------------------------------------------------------------------


def _check_webhook_url(url: str) -> None:
    """The rules job webhooks follow: https, and an address outside our own network."""
    try:
        webhooks.check_destination(url)
    except webhooks.RefusedAddress as exc:
        raise ApplicationError(str(exc), details={"webhook_url": [str(exc)]}) from None


def _check_emails(text: str) -> str:
    from django.core.validators import validate_email

    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        try:
            validate_email(address)
        except Exception:
            raise ApplicationError(
                f"{address!r} is not an email address.",
                details={"notify_emails": [f"{address!r} is not an email address."]},
            ) from None
    return ", ".join(addresses)


def _budget_snapshot(budget: Budget) -> dict:
    """For the audit log: never the webhook's signing key."""
    data = snapshot(budget)
    data.pop("webhook_signing_key", None)
    return data


@transaction.atomic
def budget_set(
    *,
    team: Team,
    monthly_limit: Decimal,
    by,
    stop_submissions: bool = False,
    notify_emails: str = "",
    webhook_url: str = "",
) -> tuple[Budget, str | None]:
    """Set a team's monthly budget. Returns it and, when a webhook URL is new, the key that
    signs its calls (shown once)."""
    _require_budget_setter(by, team)
    if monthly_limit is None or Decimal(monthly_limit) < 0:
        raise ApplicationError(
            "A budget is zero or more.", details={"monthly_limit": ["Must be 0 or more."]}
        )
    if webhook_url:
        _check_webhook_url(webhook_url)
    notify_emails = _check_emails(notify_emails or "")
    budget = Budget.objects.select_for_update().filter(team=team).first()
    before = _budget_snapshot(budget) if budget is not None else None
    new_key = None
    if budget is None:
        budget = Budget(team=team)
    if webhook_url and webhook_url != budget.webhook_url:
        new_key = secrets.token_urlsafe(32)
        budget.webhook_signing_key = encrypt(new_key)
    if not webhook_url:
        budget.webhook_signing_key = b""
    budget.monthly_limit = Decimal(monthly_limit)
    budget.stop_submissions = stop_submissions
    budget.notify_emails = notify_emails
    budget.webhook_url = webhook_url
    budget.updated_by = _by(by)
    budget.full_clean(exclude=["team", "webhook_signing_key"])
    budget.save()
    audit_record(
        actor=by,
        action="budget.set",
        obj=budget,
        before=before,
        after=_budget_snapshot(budget),
        team=team,
    )
    selectors.forget_budget_state()
    return budget, new_key


@transaction.atomic
def budget_delete(*, budget: Budget, by) -> None:
    _require_budget_setter(by, budget.team)
    audit_record(
        actor=by,
        action="budget.delete",
        obj=budget,
        before=_budget_snapshot(budget),
        team=budget.team,
    )
    budget.delete()
    selectors.forget_budget_state()


def _recipients(budget: Budget) -> list[str]:
    admins = Membership.objects.filter(team_id=budget.team_id, role=TeamRole.ADMIN).exclude(
        user__email=""
    )
    addresses = [m.user.email for m in admins.select_related("user")]
    addresses += [a.strip() for a in budget.notify_emails.split(",") if a.strip()]
    return sorted(set(addresses))


def budgets_check(*, now: dt.datetime | None = None) -> list[BudgetAlert]:
    """Alert each team whose spend this month crossed 50, 80 or 100% of its budget: once per
    threshold and month (a unique row), by email, banner and the budget's webhook."""
    now = now or timezone.now()
    month = selectors.month_start(now)
    status = {s.team_id: s for s in selectors.budget_states(month=month)}
    alerts = []
    for budget in Budget.objects.select_related("team"):
        state = status.get(budget.team_id)
        if state is None:
            continue
        made = []
        for threshold in state.crossed:
            try:
                with transaction.atomic():
                    alert, created = BudgetAlert.objects.get_or_create(
                        team_id=budget.team_id,
                        month=month,
                        threshold=threshold,
                        defaults={
                            "spent": state.spent,
                            "monthly_limit": budget.monthly_limit,
                            "at": now,
                            "webhook_state": (
                                WebhookState.PENDING if budget.webhook_url else WebhookState.NONE
                            ),
                            "webhook_next_at": now if budget.webhook_url else None,
                        },
                    )
            except IntegrityError:  # another check made it first
                continue
            if created:
                made.append(alert)
        if made:
            _email(budget, made)
            alerts.extend(made)
    if alerts:
        selectors.forget_budget_state()
        _send_webhooks_soon()
    return alerts


def _email(budget: Budget, alerts: list[BudgetAlert]) -> None:
    highest = max(alerts, key=lambda a: a.threshold)
    recipients = _recipients(budget)
    if not recipients:
        return
    team = budget.team
    month = f"{highest.month:%B %Y}"
    spent = money_text(highest.spent)
    limit = money_text(budget.monthly_limit)
    subject = (
        f"[GPU control plane] {team.slug} has spent {highest.threshold}% of its {month} budget"
    )
    lines = [
        f"Team {team.name} ({team.slug}) has spent {spent} of its monthly budget of {limit} "
        f"for {month}: past the {highest.threshold}% threshold.",
    ]
    if highest.threshold >= 100:
        lines.append(
            "Its jobs no longer burst to the cloud until the budget is raised or the month ends."
        )
        if budget.stop_submissions:
            lines.append("New submissions are refused as well.")
    lines.append(f"Details: {settings.CONTROLPLANE_URL.rstrip('/')}/costs/?team_id={team.pk}")
    try:
        send_mail(subject, "\n\n".join(lines), None, recipients)
    except Exception:  # the banner and the webhook still say it
        log.warning("could not email the budget alert for %s", team.slug, exc_info=True)
        return
    BudgetAlert.objects.filter(pk__in=[a.pk for a in alerts]).update(
        emailed_to=", ".join(recipients)[:1000]
    )


def _send_webhooks_soon() -> None:
    enqueue_on_commit("costs.deliver_budget_webhooks", covered_by="the beat")


RETRY_DELAYS_S = [30, 120, 600, 1800, 3600, 3 * 3600, 6 * 3600]


@dataclass(frozen=True)
class WebhookCall:
    alert_id: int
    url: str
    key: bytes
    payload: dict


def budget_webhooks_claim(*, now: dt.datetime | None = None, limit: int = 50) -> list[WebhookCall]:
    """The alert webhook calls that are due, each claimed for a minute (two workers never
    send the same call, and the network wait holds no lock)."""
    now = now or timezone.now()
    with transaction.atomic():
        due = list(
            BudgetAlert.objects.select_for_update(skip_locked=True)
            .filter(webhook_state=WebhookState.PENDING, webhook_next_at__lte=now)
            .order_by("webhook_next_at")[:limit]
            .values_list("id", flat=True)
        )
        BudgetAlert.objects.filter(pk__in=due).update(
            webhook_next_at=now + dt.timedelta(seconds=60)
        )
    calls = []
    for alert in BudgetAlert.objects.filter(pk__in=due).select_related("team"):
        budget = Budget.objects.filter(team_id=alert.team_id).first()
        if budget is None or not budget.webhook_url or not budget.webhook_signing_key:
            BudgetAlert.objects.filter(pk=alert.pk).update(webhook_state=WebhookState.NONE)
            continue
        calls.append(
            WebhookCall(
                alert_id=alert.pk,
                url=budget.webhook_url,
                key=decrypt(budget.webhook_signing_key).encode(),
                payload=selectors.alert_payload(alert),
            )
        )
    return calls


def budget_webhook_result(
    *, alert_id: int, status: int | None, error: str = "", now: dt.datetime | None = None
) -> str:
    now = now or timezone.now()
    alert = BudgetAlert.objects.get(pk=alert_id)
    attempts = alert.webhook_attempts + 1
    if status is not None and 200 <= status < 300:
        state, next_at = WebhookState.DELIVERED, None
    elif attempts > len(RETRY_DELAYS_S):
        state, next_at = WebhookState.FAILED, None
    else:
        state = WebhookState.PENDING
        next_at = now + dt.timedelta(seconds=RETRY_DELAYS_S[attempts - 1])
    BudgetAlert.objects.filter(pk=alert_id).update(
        webhook_state=state,
        webhook_attempts=attempts,
        webhook_next_at=next_at,
        webhook_last_error=(error or (f"HTTP {status}" if status else ""))[:300],
    )
    return state
