"""Who may change the price book and budgets."""

import logging
from typing import TYPE_CHECKING

from apps.accounts.selectors import roles_of
from controlplane.errors import ApplicationError

if TYPE_CHECKING:
    from apps.accounts.models import Team

log = logging.getLogger(__name__)


def _deny(message: str) -> ApplicationError:
    return ApplicationError(message, code="permission_denied", status=403)


def _require_finance(by) -> None:
    roles = roles_of(by) if by is not None else None
    if roles is not None and not (roles.superuser or roles.finance):
        raise _deny("Only finance edits the price book.")


def _require_budget_setter(by, team: "Team") -> None:
    roles = roles_of(by) if by is not None else None
    if roles is not None and not (roles.superuser or roles.finance or roles.is_team_admin(team.pk)):
        raise _deny(f"Only finance and admins of {team.slug} set its budget.")


def _by(by):
    return by if by is not None and by.pk else None
