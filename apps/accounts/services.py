"""Writes for teams, members, roles, service accounts and tokens; the audit log.

Every write in the control plane goes through a service that records an
AuditEvent in the same transaction, so the log and the data never disagree.
"""

import datetime as dt
import decimal
import hashlib
import secrets
import uuid
from collections.abc import Iterable

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts import principals
from apps.accounts.context import current_origin
from apps.accounts.models import (
    ApiToken,
    AuditEvent,
    Membership,
    OrgRole,
    ServiceAccount,
    Team,
    TeamQuota,
    TeamRole,
    TeamSecret,
    TokenScope,
)
from apps.accounts.secrets import decrypt, encrypt
from apps.accounts.selectors import forget_roles, roles_of
from controlplane.bulk import insert_rows
from controlplane.errors import ApplicationError

User = get_user_model()

# Never copied into the audit log.
SECRET_FIELDS = {"password", "digest", "host_key_private", "secret", "ciphertext"}
SECRET_SUFFIXES = tuple(f"_{name}" for name in SECRET_FIELDS)  # agent_token_digest...

TOKEN_PREFIX = "cp_"  # noqa: S105  (a prefix, not a secret)
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)
SCOPE_IMPLIES = {
    TokenScope.READ: {TokenScope.READ},
    TokenScope.SUBMIT: {TokenScope.READ, TokenScope.SUBMIT},
    TokenScope.ADMIN: {TokenScope.READ, TokenScope.SUBMIT, TokenScope.ADMIN},
}


# --- audit ----------------------------------------------------------------------------


def _json_value(value):
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return value


def snapshot(obj: models.Model) -> dict:
    """The object's stored fields as JSON-ready data, secrets left out."""
    data = {}
    for field in obj._meta.concrete_fields:
        if field.name in SECRET_FIELDS or field.name.endswith(SECRET_SUFFIXES):
            continue
        data[field.attname] = _json_value(getattr(obj, field.attname))
    return data


def _actor_label(actor) -> str:
    origin = current_origin()
    if actor is not None:
        return actor.get_username()
    return origin.label or "system"


def audit_record(
    *,
    actor,
    action: str,
    obj: models.Model,
    before: dict | None = None,
    after: dict | None = None,
    team: Team | None = None,
) -> AuditEvent:
    """Record one change now, with who made it and from where (the request's origin)."""
    origin = current_origin()
    return AuditEvent.objects.create(
        actor=actor if actor is not None and actor.pk else None,
        actor_label=_actor_label(actor)[:150],
        channel=origin.channel,
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        object_repr=str(obj)[:200],
        team=team,
        before=before,
        after=after,
        address=origin.address,
        request_id=origin.request_id,
    )


AUDIT_BULK_FIELDS = (
    "at",
    "actor",
    "actor_label",
    "channel",
    "action",
    "object_type",
    "object_id",
    "object_repr",
    "team",
    "before",
    "after",
    "address",
    "request_id",
)


def audit_record_many(
    *, actor, action: str, changes: Iterable[tuple[models.Model, dict, dict]], team_id=None
) -> int:
    """One audit row per changed object, inserted in one bulk statement (bulk state changes)."""
    origin = current_origin()
    label = _actor_label(actor)[:150]
    actor_id = actor.pk if actor is not None and actor.pk else None
    now = timezone.now()
    return insert_rows(
        AuditEvent,
        AUDIT_BULK_FIELDS,
        (
            (
                now,
                actor_id,
                label,
                origin.channel,
                action,
                obj._meta.label_lower,
                str(obj.pk),
                str(obj)[:200],
                team_id,
                before,
                after,
                origin.address,
                origin.request_id,
            )
            for obj, before, after in changes
        ),
    )


def _validated(obj: models.Model, *, exclude: Iterable[str] = ()) -> None:
    try:
        obj.full_clean(exclude=list(exclude))
    except ValidationError as exc:
        details = {
            ("non_field_errors" if key == "__all__" else key): value
            for key, value in exc.message_dict.items()
        }
        raise ApplicationError("Invalid input.", code="invalid", details=details) from None


def _saved(obj: models.Model) -> None:
    """Save; a uniqueness race lost to a concurrent writer is a 409, not a 500."""
    try:
        with transaction.atomic():
            obj.save()
    except IntegrityError:
        raise ApplicationError(
            f"A {obj._meta.verbose_name} like this already exists.", code="conflict", status=409
        ) from None


@transaction.atomic
def audited_create(*, model: type[models.Model], by, fields: dict, action: str, team=None):
    obj = model(**fields)
    _validated(obj)
    _saved(obj)
    audit_record(actor=by, action=action, obj=obj, after=snapshot(obj), team=team)
    return obj


@transaction.atomic
def audited_update(*, instance: models.Model, by, changes: dict, action: str, team=None):
    locked = type(instance).objects.select_for_update().get(pk=instance.pk)
    before = snapshot(locked)
    for name, value in changes.items():
        setattr(locked, name, value)
    _validated(locked)
    _saved(locked)
    after = snapshot(locked)
    if after != before:
        audit_record(actor=by, action=action, obj=locked, before=before, after=after, team=team)
    return locked


@transaction.atomic
def audited_delete(*, instance: models.Model, by, action: str, team=None) -> None:
    locked = type(instance).objects.select_for_update().get(pk=instance.pk)
    before = snapshot(locked)
    audit_record(actor=by, action=action, obj=locked, before=before, team=team)
    try:
        locked.delete()
    except models.ProtectedError as exc:
        names = sorted({str(type(o)._meta.verbose_name_plural) for o in exc.protected_objects})
        raise ApplicationError(
            f"{locked} is still used by {', '.join(names)}; remove those first.",
            code="protected",
            status=409,
        ) from None


# --- who may do what ------------------------------------------------------------------


def _deny(message: str) -> ApplicationError:
    return ApplicationError(message, code="permission_denied", status=403)


def require_fleet_manager(by) -> None:
    if by is not None and not roles_of(by).manages_fleet:
        raise _deny("Only ops may change the fleet.")


def require_team_admin(by, team: Team) -> None:
    if by is not None and not roles_of(by).is_team_admin(team.pk):
        raise _deny(f"Only admins of team {team.slug} may do this.")


def require_org_admin(by) -> None:
    roles = roles_of(by) if by is not None else None
    if roles is not None and not (roles.superuser or roles.ops):
        raise _deny("Only ops may create or delete teams and set quotas.")


# --- teams and quotas -----------------------------------------------------------------


def team_create(*, name: str, slug: str, description: str = "", by) -> Team:
    require_org_admin(by)
    return audited_create(
        model=Team,
        by=by,
        fields={"name": name, "slug": slug, "description": description},
        action="team.create",
    )


def team_update(*, team: Team, by, **changes) -> Team:
    require_team_admin(by, team)
    return audited_update(instance=team, by=by, changes=changes, action="team.update", team=team)


def team_delete(*, team: Team, by) -> None:
    require_org_admin(by)
    audited_delete(instance=team, by=by, action="team.delete")


def team_quota_set(*, team: Team, gpu_type: str, max_gpus: int, by) -> TeamQuota:
    require_org_admin(by)
    existing = TeamQuota.objects.filter(team=team, gpu_type=gpu_type).first()
    if existing is None:
        return audited_create(
            model=TeamQuota,
            by=by,
            fields={"team": team, "gpu_type": gpu_type, "max_gpus": max_gpus},
            action="team_quota.set",
            team=team,
        )
    return audited_update(
        instance=existing, by=by, changes={"max_gpus": max_gpus}, action="team_quota.set", team=team
    )


def team_quota_delete(*, quota: TeamQuota, by) -> None:
    require_org_admin(by)
    audited_delete(instance=quota, by=by, action="team_quota.delete", team=quota.team)


# --- members and org roles ------------------------------------------------------------


def _service_account_role_allowed(user, role: str) -> None:
    """A service account acts through tokens that CI holds: it may submit or read, never
    administer a team (add members, make tokens)."""
    if role == TeamRole.ADMIN and hasattr(user, "service_account"):
        raise ApplicationError(
            "A service account cannot administer a team.",
            details={"role": ["A service account may be researcher or viewer only."]},
        )


def membership_create(*, team: Team, user, role: str = TeamRole.RESEARCHER, by) -> Membership:
    require_team_admin(by, team)
    _service_account_role_allowed(user, role)
    if hasattr(user, "service_account"):
        raise ApplicationError(
            "A service account belongs to its own team only.",
            details={"user": ["Service accounts cannot join other teams."]},
        )
    if Membership.objects.filter(team=team, user=user).exists():
        raise ApplicationError(
            f"{user.get_username()} is already in {team.slug}.",
            code="conflict",
            details={"user": ["Already a member of this team."]},
        )
    membership = audited_create(
        model=Membership,
        by=by,
        fields={"team": team, "user": user, "role": role},
        action="membership.create",
        team=team,
    )
    forget_roles(user)
    return membership


def membership_update(*, membership: Membership, role: str, by) -> Membership:
    require_team_admin(by, membership.team)
    _service_account_role_allowed(membership.user, role)
    _keep_one_admin(membership, new_role=role)
    updated = audited_update(
        instance=membership,
        by=by,
        changes={"role": role},
        action="membership.update",
        team=membership.team,
    )
    forget_roles(membership.user)
    return updated


def membership_delete(*, membership: Membership, by) -> None:
    require_team_admin(by, membership.team)
    _keep_one_admin(membership, new_role=None)
    audited_delete(instance=membership, by=by, action="membership.delete", team=membership.team)
    forget_roles(membership.user)


def _keep_one_admin(membership: Membership, *, new_role: str | None) -> None:
    if membership.role != TeamRole.ADMIN or new_role == TeamRole.ADMIN:
        return
    others = Membership.objects.filter(team=membership.team, role=TeamRole.ADMIN).exclude(
        pk=membership.pk
    )
    if not others.exists():
        raise ApplicationError(
            f"{membership.team.slug} would have no admin left.",
            code="last_admin",
            status=409,
        )


def org_role_grant(*, user, role: str, by) -> OrgRole:
    if by is not None and not roles_of(by).superuser:
        raise _deny("Only superusers grant organisation roles.")
    existing = OrgRole.objects.filter(user=user, role=role).first()
    if existing:
        return existing
    granted = audited_create(
        model=OrgRole, by=by, fields={"user": user, "role": role}, action="org_role.grant"
    )
    forget_roles(user)
    return granted


# --- service accounts -----------------------------------------------------------------


@transaction.atomic
def service_account_create(
    *, team: Team, name: str, role: str = TeamRole.RESEARCHER, description: str = "", by
) -> ServiceAccount:
    require_team_admin(by, team)
    if role == TeamRole.ADMIN:
        raise ApplicationError(
            "A service account cannot administer a team.",
            details={"role": ["Choose researcher or viewer."]},
        )
    if ServiceAccount.objects.filter(team=team, name=name).exists():
        raise ApplicationError(
            f"{team.slug} already has a service account named {name}.",
            code="conflict",
            details={"name": ["Already taken in this team."]},
        )
    username = f"sa.{team.slug}.{name}"[:150]
    if User.objects.filter(username=username).exists():
        raise ApplicationError(f"The username {username} is taken.", details={"name": ["Taken."]})
    user = User(username=username, is_active=True)
    user.set_unusable_password()
    user.save()
    account = audited_create(
        model=ServiceAccount,
        by=by,
        fields={
            "user": user,
            "team": team,
            "name": name,
            "description": description,
            "created_by": by if by is not None and by.pk else None,
        },
        action="service_account.create",
        team=team,
    )
    Membership.objects.create(user=user, team=team, role=role)
    return account


@transaction.atomic
def service_account_delete(*, account: ServiceAccount, by) -> None:
    require_team_admin(by, account.team)
    team = account.team
    user = account.user
    ApiToken.objects.filter(user=user, revoked_at__isnull=True).update(revoked_at=timezone.now())
    audited_delete(instance=account, by=by, action="service_account.delete", team=team)
    user.is_active = False
    user.save(update_fields=["is_active"])


# --- API tokens -----------------------------------------------------------------------


def token_digest(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _team_of(user) -> Team | None:
    account = getattr(user, "service_account", None)
    return account.team if account is not None else None


@transaction.atomic
def api_token_create(
    *,
    user,
    name: str,
    scopes: list[str],
    expires_at: dt.datetime | None = None,
    by,
    parent: ApiToken | None = None,
) -> tuple[ApiToken, str]:
    """Make a token for `user`; returns the row and the secret, which is never stored.

    `parent` is the token the request that asks was authenticated with (none for a browser
    session): the new token is contained by it, so that revoking or expiring a leaked token
    also ends every token made with it.
    """
    team = _team_of(user)
    if by is not None and by.pk != user.pk:
        if team is None:
            raise _deny("Tokens for a person are made by that person.")
        require_team_admin(by, team)
    unknown = sorted(set(scopes) - set(TokenScope.values))
    if not scopes or unknown:
        raise ApplicationError(
            "Choose at least one scope of read, submit, admin.",
            details={"scopes": [f"Unknown scope: {s}" for s in unknown] or ["Required."]},
        )
    if parent is not None:
        # Locked, so that a revocation of the parent either sees this token or comes first.
        parent = ApiToken.objects.select_for_update().get(pk=parent.pk)
        if parent.revoked_at is not None:
            raise ApplicationError(
                "This request's token has been revoked.", code="authentication_failed", status=401
            )
        beyond = sorted(scope for scope in set(scopes) if not token_allows(parent, scope))
        if beyond:
            raise ApplicationError(
                "A token cannot hold a scope the token that makes it lacks.",
                details={"scopes": [f"Not held by this request's token: {s}" for s in beyond]},
            )
        if parent.expires_at is not None:
            if expires_at is None:
                expires_at = parent.expires_at
            elif expires_at > parent.expires_at:
                raise ApplicationError(
                    "A token cannot outlive the token that makes it.",
                    details={
                        "expires_at": [f"At most {parent.expires_at.isoformat()}, its expiry."]
                    },
                )
    if expires_at is not None and expires_at <= timezone.now():
        raise ApplicationError(
            "The expiry is in the past.", details={"expires_at": ["Must be in the future."]}
        )
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(
        user=user,
        name=name,
        prefix=raw[: len(TOKEN_PREFIX) + 8],
        digest=token_digest(raw),
        scopes=sorted(set(scopes)),
        expires_at=expires_at,
        created_by=by if by is not None and by.pk else None,
        parent=parent,
    )
    _validated(token, exclude=["digest"])
    token.save()
    audit_record(actor=by, action="api_token.create", obj=token, after=snapshot(token), team=team)
    return token, raw


@transaction.atomic
def api_token_revoke(*, token: ApiToken, by) -> ApiToken:
    team = _team_of(token.user)
    if by is not None and by.pk != token.user_id:
        if team is None:
            raise _deny("Only the token's owner may revoke it.")
        require_team_admin(by, team)
    locked = ApiToken.objects.select_for_update().get(pk=token.pk)
    if locked.revoked_at is not None:
        return locked
    before = snapshot(locked)
    locked.revoked_at = timezone.now()
    locked.save(update_fields=["revoked_at"])
    audit_record(
        actor=by,
        action="api_token.revoke",
        obj=locked,
        before=before,
        after=snapshot(locked),
        team=team,
    )
    _revoke_descendants(locked, by=by)
    return locked


def _revoke_descendants(token: ApiToken, *, by) -> None:
    """Revoke every token made with this one, and those made with them, in its transaction."""
    revoked = []
    level = [token.pk]
    while level:
        children = list(
            ApiToken.objects.select_for_update(of=("self",))
            .select_related("user__service_account")
            .filter(parent_id__in=level, revoked_at__isnull=True)
        )
        revoked += children
        level = [child.pk for child in children]
    if not revoked:
        return
    ApiToken.objects.filter(pk__in=[child.pk for child in revoked]).update(
        revoked_at=token.revoked_at
    )
    by_team = {}
    for child in revoked:
        before = snapshot(child)
        child.revoked_at = token.revoked_at
        team = _team_of(child.user)
        by_team.setdefault(team.pk if team else None, []).append((child, before, snapshot(child)))
    for team_id, changes in by_team.items():
        audit_record_many(actor=by, action="api_token.revoke", changes=changes, team_id=team_id)
    # A queryset update sends no signal: mark their cached answers stale here.
    principals.forget_digests([child.digest for child in revoked])


class TokenRejected(Exception):
    """The presented token is unknown, revoked or expired (401, not 403)."""


def api_token_use(*, raw: str, now: dt.datetime | None = None) -> ApiToken:
    """Authenticate one request's token; note its use at most once a minute.

    Answered from the auth cache when it can be (principals.py). An entry lives
    until its last_used_at is a minute old, so last_used_at is written when the
    entry expires and the database is read again.
    """
    now = now or timezone.now()
    digest = token_digest(raw)
    stale = now - LAST_USED_RESOLUTION
    cached = principals.recall(digest)
    if cached is not None and cached[0].last_used_at > stale:
        token, roles = cached
        token.user._controlplane_roles = roles
    else:
        cached = None
        token = ApiToken.objects.select_related("user", "parent").filter(digest=digest).first()
        if token is None:
            raise TokenRejected("Invalid token.")
    if token.revoked_at is not None:
        raise TokenRejected("This token has been revoked.")
    if token.expires_at is not None and token.expires_at <= now:
        raise TokenRejected("This token has expired.")
    parent = token.parent
    if parent is not None and (
        parent.revoked_at is not None
        or (parent.expires_at is not None and parent.expires_at <= now)
    ):
        raise TokenRejected("The token that made this token has been revoked or has expired.")
    if not token.user.is_active:
        raise TokenRejected("The token's user is inactive.")
    if cached is None:
        if token.last_used_at is None or token.last_used_at <= stale:
            # Conditional, so concurrent requests write the row once, not each.
            ApiToken.objects.filter(pk=token.pk).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lte=stale)
            ).update(last_used_at=now)
            token.last_used_at = now
        # Cached only until its last_used_at goes stale, so a hit never needs a write.
        fresh_for = (token.last_used_at - stale).total_seconds()
        principals.remember(digest, token, roles_of(token.user), timeout=fresh_for)
    return token


def token_allows(token: ApiToken, scope: str) -> bool:
    granted = set()
    for held in token.scopes:
        granted |= SCOPE_IMPLIES.get(held, set())
    return scope in granted


# --- team secrets --------------------------------------------------------------------


@transaction.atomic
def team_secret_set(*, team: Team, name: str, value: str, by) -> TeamSecret:
    """Set (or replace) a team secret. Team admins only; the value is stored encrypted."""
    require_team_admin(by, team)
    if not value:
        raise ApplicationError("A secret needs a value.", details={"value": ["Required."]})
    existing = TeamSecret.objects.select_for_update().filter(team=team, name=name).first()
    if existing is not None:
        existing.ciphertext = encrypt(value)
        existing.save(update_fields=["ciphertext", "updated_at"])
        audit_record(
            actor=by, action="team_secret.replace", obj=existing, team=team, after={"name": name}
        )
        return existing
    secret = TeamSecret(
        team=team,
        name=name,
        ciphertext=encrypt(value),
        created_by=by if by is not None and by.pk else None,
    )
    _validated(secret, exclude=["ciphertext"])
    _saved(secret)
    audit_record(actor=by, action="team_secret.create", obj=secret, team=team, after={"name": name})
    return secret


def team_secret_delete(*, secret: TeamSecret, by) -> None:
    require_team_admin(by, secret.team)
    audited_delete(instance=secret, by=by, action="team_secret.delete", team=secret.team)


def team_secret_values(*, team: Team, names: list[str]) -> dict[str, str]:
    """The decrypted values, for the run plan of a job on its nodes (never for display)."""
    rows = TeamSecret.objects.filter(team=team, name__in=names)
    return {row.name: decrypt(row.ciphertext) for row in rows}
