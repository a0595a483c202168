"""Keep the auth cache exact: any change to who a token's user is marks its tokens stale.

Signals rather than calls in each service, because users, memberships and
org roles are also written by Django's own admin and auth views.
"""

from django.contrib.auth import get_user_model
from django.db.models.signals import post_delete, post_save

from apps.accounts import principals, selectors
from apps.accounts.models import ApiToken, Membership, OrgRole, Team, TeamQuota


def _token_changed(sender, instance, created=False, **kwargs):
    if not created:  # a new token cannot be cached yet
        principals.forget_digests([instance.digest])


def _user_changed(sender, instance, **kwargs):
    principals.forget_user(instance.pk)


def _roles_changed(sender, instance, **kwargs):
    principals.forget_user(instance.user_id)


def _team_changed(sender, instance, **kwargs):
    selectors.team_forget(instance.pk)


def _quota_changed(sender, instance, **kwargs):
    selectors.team_forget(instance.team_id)


def connect() -> None:
    for name, signal in (("saved", post_save), ("deleted", post_delete)):
        signal.connect(_token_changed, sender=ApiToken, dispatch_uid=f"auth-token-{name}")
        signal.connect(_user_changed, sender=get_user_model(), dispatch_uid=f"auth-user-{name}")
        signal.connect(_roles_changed, sender=Membership, dispatch_uid=f"auth-membership-{name}")
        signal.connect(_roles_changed, sender=OrgRole, dispatch_uid=f"auth-org-role-{name}")
        signal.connect(_team_changed, sender=Team, dispatch_uid=f"submit-team-{name}")
        signal.connect(_quota_changed, sender=TeamQuota, dispatch_uid=f"submit-quota-{name}")
