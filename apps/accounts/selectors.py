"""Reads about who may see and do what; every list the API serves is scoped here."""

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet, Value

from apps.accounts.models import (
    ApiToken,
    AuditEvent,
    Membership,
    OrgRole,
    OrgRoleName,
    ServiceAccount,
    Team,
    TeamQuota,
    TeamRole,
    TeamSecret,
)
from apps.accounts.secrets import decrypt
from controlplane.exactcache import ExactCache

User = get_user_model()


@dataclass(frozen=True)
class Roles:
    """What one user is, read once per request."""

    superuser: bool
    ops: bool
    finance: bool
    team_roles: dict[int, str]  # team id -> role

    @property
    def team_ids(self) -> set[int]:
        return set(self.team_roles)

    @property
    def admin_team_ids(self) -> set[int]:
        return {tid for tid, role in self.team_roles.items() if role == TeamRole.ADMIN}

    @property
    def sees_every_team(self) -> bool:
        return self.superuser or self.ops or self.finance

    def is_team_admin(self, team_id: int) -> bool:
        return self.superuser or self.team_roles.get(team_id) == TeamRole.ADMIN

    def can_submit_for(self, team_id: int) -> bool:
        return self.superuser or self.team_roles.get(team_id) in (
            TeamRole.ADMIN,
            TeamRole.RESEARCHER,
        )

    @property
    def manages_fleet(self) -> bool:
        return self.superuser or self.ops


_NOBODY = Roles(superuser=False, ops=False, finance=False, team_roles={})


def roles_of(user) -> Roles:
    """The user's roles, cached on the user object for the rest of the request."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return _NOBODY
    cached = getattr(user, "_controlplane_roles", None)
    if cached is not None:
        return cached
    # One round trip: organisation roles (team 0) and team memberships together.
    org_roles = (
        OrgRole.objects.filter(user_id=user.pk)
        .annotate(team=Value(0))
        .values_list("team", "role")
        .order_by()
    )
    rows = Membership.objects.filter(user_id=user.pk).values_list("team_id", "role").order_by()
    org, team_roles = set(), {}
    for team_id, role in rows.union(org_roles, all=True):
        if team_id == 0:
            org.add(role)
        else:
            team_roles[team_id] = role
    roles = Roles(
        superuser=user.is_superuser,
        ops=OrgRoleName.OPS in org,
        finance=OrgRoleName.FINANCE in org,
        team_roles=team_roles,
    )
    user._controlplane_roles = roles
    return roles


def forget_roles(user) -> None:
    if hasattr(user, "_controlplane_roles"):
        del user._controlplane_roles


def teams_visible_to(*, user) -> QuerySet[Team]:
    roles = roles_of(user)
    teams = Team.objects.all()
    return teams if roles.sees_every_team else teams.filter(id__in=roles.team_ids)


def teams_budgeted_by(*, user) -> QuerySet[Team]:
    """The teams whose budgets the user sets: every team for finance, else those it admins."""
    roles = roles_of(user)
    if roles.superuser or roles.finance:
        return Team.objects.all()
    return Team.objects.filter(pk__in=roles.admin_team_ids)


def quotas_visible_to(*, user) -> QuerySet[TeamQuota]:
    roles = roles_of(user)
    quotas = TeamQuota.objects.select_related("team")
    return quotas if roles.sees_every_team else quotas.filter(team_id__in=roles.team_ids)


def memberships_visible_to(*, user) -> QuerySet[Membership]:
    roles = roles_of(user)
    memberships = Membership.objects.select_related("team", "user")
    if roles.sees_every_team:
        return memberships
    return memberships.filter(team_id__in=roles.team_ids)


def service_accounts_visible_to(*, user) -> QuerySet[ServiceAccount]:
    roles = roles_of(user)
    accounts = ServiceAccount.objects.select_related("team", "user")
    if roles.superuser or roles.ops:
        return accounts
    return accounts.filter(team_id__in=roles.team_ids)


def service_accounts_managed_by(*, user) -> QuerySet[ServiceAccount]:
    """The service accounts whose tokens the user makes: those of teams they administer."""
    roles = roles_of(user)
    accounts = ServiceAccount.objects.select_related("team", "user").order_by("team__slug", "name")
    return accounts if roles.superuser else accounts.filter(team_id__in=roles.admin_team_ids)


def tokens_visible_to(*, user) -> QuerySet[ApiToken]:
    """A user's own tokens, and those of service accounts of teams they administer."""
    roles = roles_of(user)
    # The service account's team too: the tokens page names it on every such token.
    tokens = ApiToken.objects.select_related("user", "user__service_account__team")
    if not getattr(user, "is_authenticated", False):
        return tokens.none()
    if roles.superuser:
        return tokens
    return tokens.filter(Q(user=user) | Q(user__service_account__team_id__in=roles.admin_team_ids))


def audit_events_visible_to(*, user) -> QuerySet[AuditEvent]:
    roles = roles_of(user)
    events = AuditEvent.objects.select_related("team")
    if roles.superuser or roles.ops:
        return events
    return events.filter(team_id__in=roles.admin_team_ids)


def users_visible_to(*, user) -> QuerySet:
    """People one may name (to add to a team): every active user, for anyone signed in.

    Usernames are not secret inside the organisation; what one may do with them is
    decided by the services (only team admins add members).
    """
    if not getattr(user, "is_authenticated", False):
        return User.objects.none()
    return User.objects.filter(is_active=True)


def team_secrets_visible_to(*, user) -> QuerySet[TeamSecret]:
    """Names (never values) of the secrets of the user's teams."""
    roles = roles_of(user)
    secrets = TeamSecret.objects.select_related("team")
    if roles.superuser:
        return secrets
    return secrets.filter(team_id__in=roles.team_ids)


# Submission reads a team and its quotas on every request: kept in the cache, exactly
# (controlplane/exactcache.py), marked stale by accounts/signals.py when either changes.
_teams = ExactCache("accounts:team", max_timeout_s=300)


def team_for_submission(*, user, team_id: int) -> Team | None:
    """The team, if the user may see it (others "do not exist"), with its quota limits."""
    roles = roles_of(user)
    if not roles.sees_every_team and team_id not in roles.team_ids:
        return None
    cached = _teams.recall(str(team_id))
    if cached is not None:
        return cached
    team = Team.objects.filter(pk=team_id).first()
    if team is None:
        return None
    team.quota_limits = quota_limits(team_id=team.pk)
    _teams.remember(str(team_id), team)
    return team


def quota_limits(*, team_id: int) -> dict[str, int]:
    """GPU type → the team's nominal quota plus its borrowing limit."""
    return {
        gpu_type: nominal + borrow
        for gpu_type, nominal, borrow in TeamQuota.objects.filter(team_id=team_id).values_list(
            "gpu_type", "max_gpus", "borrow_gpus"
        )
    }


def team_forget(team_id: int) -> None:
    _teams.forget([str(team_id)])


def team_slugs(*, team_ids) -> dict[int, str]:
    return dict(Team.objects.filter(pk__in=team_ids).values_list("id", "slug"))


def team_admin_emails(*, team_id: int) -> list[str]:
    """The addresses of the team's admins who have one."""
    admins = Membership.objects.filter(team_id=team_id, role=TeamRole.ADMIN).exclude(user__email="")
    return [m.user.email for m in admins.select_related("user")]


def team_secret_names(*, team_id: int, names) -> set[str]:
    """Those of `names` the team has a secret by."""
    return set(
        TeamSecret.objects.filter(team_id=team_id, name__in=names).values_list("name", flat=True)
    )


def team_secret_values(*, team_id: int, names) -> dict[str, str]:
    """The team's secrets by these names, decrypted: for the runs that were given them."""
    stored = TeamSecret.objects.filter(team_id=team_id, name__in=names)
    return {secret.name: decrypt(secret.ciphertext) for secret in stored}


def team_ids_by_slug(*, slugs) -> dict[str, int]:
    return dict(Team.objects.filter(slug__in=slugs).values_list("slug", "id"))


def team_by_key(key) -> Team | None:
    """A team by id (an int) or slug."""
    lookup = {"pk": key} if isinstance(key, int) else {"slug": str(key)}
    return Team.objects.filter(**lookup).first()


def first_team_of(*, user) -> Team | None:
    """The user's first team by slug (what a run counts to when its starter names none)."""
    return Team.objects.filter(pk__in=roles_of(user).team_ids).order_by("slug").first()
