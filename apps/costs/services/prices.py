"""Writes to the price book: owned and cloud prices, pool discounts, spot quotes."""

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from django.db import transaction
from django.db.models import Q

from apps.accounts.services import (
    audited_create,
    audited_delete,
    audited_update,
)
from apps.costs import selectors
from apps.costs.models import (
    CloudPrice,
    MeterMark,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
)
from apps.costs.services.access import _by, _require_finance
from apps.fleet import selectors as fleet
from apps.fleet.models import PoolKind
from apps.fleet.models.nodes import CapacityType
from controlplane.errors import ApplicationError


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
        node_id__in=fleet.node_ids_where(nodes), metered_until__gt=since
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
    types = fleet.instance_type_ids_by_name()
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
