"""Budget states, the budget boundary the scheduler asks, what a burst would cost against it,
and banners."""

import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.db.models import QuerySet, Sum
from django.utils import timezone

from apps.accounts.selectors import roles_of
from apps.costs import pricing
from apps.costs.models import (
    THRESHOLDS,
    Budget,
    BudgetAlert,
    MonthlySpend,
)
from apps.costs.money import ZERO, money_text
from apps.costs.selectors.months import (
    CAPACITY_LABELS,
    month_after,
    month_start,
    time_zone,
)
from apps.costs.selectors.prices import NodeRow, PriceBook, rate_now
from apps.costs.selectors.spend import (
    ForecastWindow,
    RollUps,
    _of_visible_teams,
    fleet_cost,
    rollups_between,
)
from apps.fleet import cloud
from apps.fleet import selectors as fleet_reads
from apps.fleet.models import (
    CapacityPreference,
)
from apps.fleet.models.nodes import CapacityType
from controlplane import webhooks
from controlplane.cache import best_effort

log = logging.getLogger(__name__)


# --- budgets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetState:
    team_id: int
    team: str
    monthly_limit: Decimal
    spent: Decimal
    forecast: Decimal | None
    stop_submissions: bool
    webhook: bool
    month: dt.date

    @property
    def percent(self) -> Decimal:
        if not self.monthly_limit:
            return Decimal(100) if self.spent >= 0 else ZERO
        return self.spent * 100 / self.monthly_limit

    @property
    def crossed(self) -> list[int]:
        """The alert thresholds (percent of the limit) the spend has reached."""
        return [t for t in THRESHOLDS if self.spent >= self.monthly_limit * t / 100]

    @property
    def level(self) -> int:
        return max(self.crossed, default=0)

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.monthly_limit


def team_spend(*, since: dt.date, until: dt.date, team_ids=None) -> dict[int, Decimal]:
    rollups = rollups_between(since=since, until=until)
    if team_ids is not None:
        team_ids = list(team_ids)
        rollups = RollUps(
            daily=rollups.daily.filter(team_id__in=team_ids),
            monthly=rollups.monthly.filter(team_id__in=team_ids),
        )
    return {
        row["team_id"]: row["amount"]
        for row in rollups.sums(("team_id",), since=since, until=until)
        if row["team_id"] != 0
    }


def forecast_month(
    *, month: dt.date, team_ids=None, now: dt.datetime | None = None, fleet: bool = False
):
    """Spend to the month's end: spent so far + the average of the last COSTS_FORECAST_DAYS
    whole days × the days left. Per team ({team id: amount}), or with `fleet` for the whole
    fleet (one amount)."""
    window = ForecastWindow.of(month, now)
    left = window.days_left
    if fleet:
        spent = fleet_cost(since=month, until=window.last)
        if not left:
            return spent
        return spent + fleet_cost(since=window.since, until=window.until) / window.days * left
    spent = team_spend(since=month, until=window.last, team_ids=team_ids)
    recent = team_spend(since=window.since, until=window.until, team_ids=team_ids) if left else {}
    return {
        team_id: spent.get(team_id, ZERO) + recent.get(team_id, ZERO) / window.days * left
        for team_id in set(spent) | set(recent)
    }


def budget_states(
    *, month: dt.date | None = None, team_ids=None, forecast: bool = True
) -> list[BudgetState]:
    month = month or month_start()
    budgets = Budget.objects.select_related("team").order_by("team__slug")
    if team_ids is not None:
        budgets = budgets.filter(team_id__in=list(team_ids))
    budgets = list(budgets)
    if not budgets:
        return []
    ids = [b.team_id for b in budgets]
    spent = team_spend(since=month, until=month_after(month) - dt.timedelta(days=1), team_ids=ids)
    projected = forecast_month(month=month, team_ids=ids) if forecast else {}
    return [
        BudgetState(
            team_id=b.team_id,
            team=b.team.slug,
            monthly_limit=b.monthly_limit,
            spent=spent.get(b.team_id, ZERO),
            forecast=projected.get(b.team_id, spent.get(b.team_id, ZERO)) if forecast else None,
            stop_submissions=b.stop_submissions,
            webhook=bool(b.webhook_url),
            month=month,
        )
        for b in budgets
    ]


def budgets_visible_to(*, user) -> QuerySet[Budget]:
    return _of_visible_teams(Budget.objects.select_related("team"), user)


def budget_webhook_url_seen_by(*, budget: Budget, user) -> str:
    """The alert webhook's URL whole for who may set the budget (finance, the team's admins)
    and ops; for other members, without the credentials its user information and query may
    carry."""
    roles = roles_of(user)
    if roles.sees_every_team or roles.is_team_admin(budget.team_id):
        return budget.webhook_url
    return webhooks.redacted_url(budget.webhook_url)


def budget_alerts_visible_to(*, user) -> QuerySet[BudgetAlert]:
    return _of_visible_teams(BudgetAlert.objects.select_related("team", "webhook_call"), user)


# The budget boundary: read on every scheduling pass for every team with pending jobs,
# so every team's budget and spend this month are read in one go and kept for
# COSTS_BUDGET_CACHE_S (and forgotten at once when this process changes a budget, a price
# or the ledger). A pass asks for each of a thousand teams: a fresh answer costs two clock
# readings, not a time-zone conversion (the month's end is kept as a timestamp).
_out_of_budget: dict = {
    "read_at": float("-inf"),
    "month_ends": float("-inf"),
    "teams": frozenset(),  # the teams whose spend has reached their budget
    "budgets": {},  # team id -> BudgetState, for the teams with a budget
}


def forget_budget_state() -> None:
    _out_of_budget["read_at"] = float("-inf")


def _budget_boundary() -> dict:
    kept = _out_of_budget
    if (
        time.monotonic() - kept["read_at"] < settings.COSTS_BUDGET_CACHE_S
        and time.time() < kept["month_ends"]
    ):
        return kept
    month = month_start()
    states = budget_states(month=month, forecast=False)
    ends = dt.datetime.combine(month_after(month), dt.time(), tzinfo=time_zone()).timestamp()
    kept.update(
        read_at=time.monotonic(),
        month_ends=ends,
        teams=frozenset(s.team_id for s in states if s.exhausted),
        budgets={s.team_id: s for s in states},
    )
    return kept


def teams_out_of_budget() -> frozenset[int]:
    return _budget_boundary()["teams"]


def team_within_budget(*, team_id: int) -> bool:
    """False once the team's spend this month reached its budget (100%): no cloud bursts."""
    return team_id not in teams_out_of_budget()


# --- what a burst will cost, against its team's budget ---------------------------------------


@dataclass(frozen=True)
class BurstPrice:
    """What a node of a burst would cost: the pool's instance type for it, spot or not."""

    pool: str
    instance_type: str
    capacity_type: str
    per_node_hour: Decimal | None  # None: the price book has no price for it
    node_gpus: int


def burst_prices(*, wants, at: dt.datetime | None = None) -> dict[tuple, BurstPrice | None]:
    """{(pool id, GPUs per node, spot): its price now}, None for a pool that is gone or has
    no instance type that big. Spot is priced as metering will price it (the dearest
    zone, or on-demand while no spot price is known). A few queries for any number."""
    at = at or timezone.now()
    wants = set(wants)
    pools = fleet_reads.pools_with_instance_types(pool_ids={w[0] for w in wants})
    nodes: dict[tuple, NodeRow | None] = {}
    for key in wants:
        pool_id, gpus_per_node, spot = key
        pool = pools.get(pool_id)
        itype = None if pool is None else cloud.burst_instance_type(pool, gpus_per_node)
        if itype is None:
            nodes[key] = None
            continue
        spot = spot and pool.capacity_preference == CapacityPreference.SPOT_THEN_ON_DEMAND
        nodes[key] = NodeRow(
            id=0,
            pool_id=pool.pk,
            instance_type_id=itype.pk,
            capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
            gpus=itype.gpu_count,
            billable_from=None,
            billable_until=None,
            power_w=None,
            region=pool.region or "",
        )
    known = [n for n in nodes.values() if n is not None]
    book = PriceBook.read(known, since=at, until=at + dt.timedelta(seconds=1))
    types = {t.pk: t.name for pool in pools.values() for t in pool.instance_types.all()}
    prices: dict[tuple, BurstPrice | None] = {}
    for key, node in nodes.items():
        if node is None:
            prices[key] = None
            continue
        rate = rate_now(book.timeline(node, None), at)
        prices[key] = BurstPrice(
            pool=pools[node.pool_id].slug,
            instance_type=types[node.instance_type_id],
            capacity_type=node.capacity_type,
            per_node_hour=None if rate is pricing.UNPRICED else rate.per_hour,
            node_gpus=node.gpus,
        )
    return prices


@dataclass(frozen=True)
class BurstCost:
    """A cloud burst the scheduler would ask for: whose, where, and how big and long."""

    job_id: int
    team_id: int
    pool_id: int
    spot: bool
    nodes: int
    gpus_per_node: int
    time_limit_s: int
    max_cost: Decimal | None = None  # the job's max_cost_usd


@dataclass(frozen=True)
class BurstVerdict:
    allowed: bool
    projected: Decimal | None  # None: no budget to hold it against, or no price known
    reason: str = ""  # why not, in words for the job's waiting reason


def bursts_within_budget(*, bursts, at: dt.datetime | None = None) -> dict[int, BurstVerdict]:
    """{job id: verdict} for a scheduling pass's bursts, in the order given (the queue's).

    A burst goes only if its team's spend this month, plus the projected cost of the
    bursts allowed before it in this pass, plus its own projected cost
    (pricing.burst_cost) stays within the team's budget. A team without a budget bursts
    freely, and its bursts are not even priced. A burst whose price is unknown (no price
    in the book, or no instance type that fits) and that has no max_cost_usd to bound it
    is refused: what it would cost cannot be held against the budget, and metering would
    count it as free."""
    bursts = list(bursts)
    budgets = _budget_boundary()["budgets"]
    held = [b for b in bursts if b.team_id in budgets]
    verdicts = {b.job_id: BurstVerdict(allowed=True, projected=None) for b in bursts}
    if not held:
        return verdicts
    prices = burst_prices(wants={(b.pool_id, b.gpus_per_node, b.spot) for b in held}, at=at)
    committed: dict[int, Decimal] = defaultdict(lambda: ZERO)
    for burst in held:
        budget = budgets[burst.team_id]
        price = prices[(burst.pool_id, burst.gpus_per_node, burst.spot)]
        projected = pricing.burst_cost(
            gpus=burst.nodes * burst.gpus_per_node,
            time_limit_s=burst.time_limit_s,
            per_node_hour=None if price is None else price.per_node_hour,
            node_gpus=0 if price is None else price.node_gpus,
            max_cost=burst.max_cost,
        )
        left = budget.monthly_limit - budget.spent - committed[burst.team_id]
        if projected is None:
            verdicts[burst.job_id] = BurstVerdict(
                allowed=False, projected=None, reason=_unpriced_reason(burst, price, budget)
            )
            _warn_unpriced(burst, price)
        elif projected > left:
            verdicts[burst.job_id] = BurstVerdict(
                allowed=False,
                projected=projected,
                reason=_over_budget_reason(burst, price, budget, projected, left),
            )
        else:
            committed[burst.team_id] += projected
            verdicts[burst.job_id] = BurstVerdict(allowed=True, projected=projected)
    return verdicts


def _burst_words(burst: BurstCost, price: BurstPrice | None) -> str:
    """'2 × 8 GPUs for 10 h on aws-p5 (p5.48xlarge, spot)'."""
    if burst.nodes == 1:
        gpus = f"{burst.gpus_per_node} GPUs"
    else:
        gpus = f"{burst.nodes} × {burst.gpus_per_node} GPUs"
    if price is None:
        where = f"cloud pool {burst.pool_id}"
    else:
        capacity = CAPACITY_LABELS[price.capacity_type].lower()
        where = f"{price.pool} ({price.instance_type}, {capacity})"
    return f"{gpus} for {burst.time_limit_s / 3600:g} h on {where}"


def _over_budget_reason(burst, price, budget: BudgetState, projected, left) -> str:
    return (
        f"no cloud burst: {_burst_words(burst, price)} could cost "
        f"{money_text(projected)}, and team {budget.team} has "
        f"{money_text(max(left, ZERO))} of its {money_text(budget.monthly_limit)} "
        f"budget left this month"
    )


def _unpriced_reason(burst, price, budget: BudgetState) -> str:
    missing = "no instance type that fits" if price is None else "no price in the price book"
    return (
        f"no cloud burst: {_burst_words(burst, price)} has {missing}, so its cost "
        f"cannot be held against team {budget.team}'s budget"
    )


def _warn_unpriced(burst: BurstCost, price: BurstPrice | None) -> None:
    """Once per pool and kind every ten minutes, not on every pass."""
    if price is None:
        return  # the fleet's burst request says so itself
    key = f"costs:burst-unpriced:{burst.pool_id}:{price.instance_type}:{price.capacity_type}"
    if best_effort.add(key, 1, timeout=600):
        log.warning(
            "no price for %s %s in pool %s: bursts of teams with a budget are refused",
            price.instance_type,
            price.capacity_type,
            price.pool,
        )


def submissions_refused(*, team_id: int) -> BudgetState | None:
    """The team's budget state when it is spent and set to refuse new jobs, else None."""
    if team_within_budget(team_id=team_id):
        return None
    state = next(iter(budget_states(team_ids=[team_id], forecast=False)), None)
    return state if state is not None and state.stop_submissions else None


def alert_payload(alert: BudgetAlert) -> dict:
    return {
        "team": alert.team.slug,
        "team_id": alert.team_id,
        "month": f"{alert.month:%Y-%m}",
        "threshold_percent": alert.threshold,
        "spent": str(alert.spent.quantize(Decimal("0.01"))),
        "monthly_limit": str(alert.monthly_limit),
        "currency": settings.COSTS_CURRENCY,
        "at": alert.at.isoformat(),
    }


def banners_for(*, user) -> list[dict]:
    """This month's highest alert of each of the user's teams (members see their teams')."""
    roles = roles_of(user)
    if not roles.team_ids:
        return []
    month = month_start()
    latest: dict[int, BudgetAlert] = {}
    for alert in BudgetAlert.objects.filter(month=month, team_id__in=roles.team_ids).select_related(
        "team"
    ):
        if alert.team_id not in latest or alert.threshold > latest[alert.team_id].threshold:
            latest[alert.team_id] = alert
    return [
        {
            "team": alert.team.slug,
            "team_id": alert.team_id,
            "threshold": alert.threshold,
            "level": "error" if alert.threshold >= 100 else "warning",
            "text": (
                f"Team {alert.team.slug} has spent {alert.threshold}% or more of its "
                f"{money_text(alert.monthly_limit)} budget for {alert.month:%B %Y}"
                + (": its jobs no longer burst to the cloud." if alert.threshold >= 100 else ".")
            ),
        }
        for alert in sorted(latest.values(), key=lambda a: a.team.slug)
    ]


def spend_by_team_total() -> dict[int, Decimal]:
    """Every team's spend since the ledger began (team 0: idle capacity), from the monthly
    roll-ups: a few rows per team and month, however long the ledger."""
    rows = MonthlySpend.objects.values("team_id").annotate(total=Sum("amount")).order_by()
    return {row["team_id"]: row["total"] or Decimal(0) for row in rows}
