"""Budgets and their alerts: setting them, checking spend against them, mail and webhooks."""

import datetime as dt
import logging
import secrets
from decimal import Decimal
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.accounts.secrets import encrypt
from apps.accounts.selectors import team_admin_emails
from apps.accounts.services import (
    audit_record,
    snapshot,
)
from apps.costs import selectors
from apps.costs.models import (
    Budget,
    BudgetAlert,
)
from apps.costs.money import money_text
from apps.costs.services.access import _by, _require_budget_setter
from apps.outbox import services as outbox
from controlplane import webhooks
from controlplane.errors import ApplicationError

if TYPE_CHECKING:
    from apps.accounts.models import Team

log = logging.getLogger(__name__)


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
    team: "Team",
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
    if budget.pk and webhook_url != budget.webhook_url:
        outbox.calls_drop(source=_source(budget))
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


def _source(budget: Budget) -> str:
    """The outbox's name for a budget's webhook: its calls are dropped when it moves."""
    return f"budget:{budget.pk}"


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
    outbox.calls_drop(source=_source(budget))
    budget.delete()
    selectors.forget_budget_state()


def _recipients(budget: Budget) -> list[str]:
    addresses = team_admin_emails(team_id=budget.team_id)
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
                        },
                    )
                    if created and budget.webhook_url:
                        _owe_webhook_call(budget, alert, now=now)
            except IntegrityError:  # another check made it first
                continue
            if created:
                made.append(alert)
        if made:
            _email(budget, made)
            alerts.extend(made)
    if alerts:
        selectors.forget_budget_state()
    return alerts


def _owe_webhook_call(budget: Budget, alert: BudgetAlert, *, now: dt.datetime) -> None:
    alert.team = budget.team
    (alert.webhook_call,) = outbox.calls_owe(
        [
            outbox.Call(
                team_id=budget.team_id,
                topic="budget.alert",
                source=_source(budget),
                url=budget.webhook_url,
                signing_key=budget.webhook_signing_key,
                payload=selectors.alert_payload(alert),
            )
        ],
        now=now,
    )
    alert.save(update_fields=["webhook_call"])


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
