"""The sign-in forms (the login page's and the admin's), and the API tokens page's form: a
token for yourself or for a service account of a team you administer."""

import datetime as dt

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.utils import timezone

from apps.accounts.backends import signin_refused
from apps.accounts.models import TokenScope
from apps.accounts.selectors import service_accounts_managed_by

THROTTLED = "throttled"


class ThrottledSignInMixin:
    """Says why a sign-in is refused while the throttle holds (the backend refuses it anyway)."""

    def clean(self):
        username = self.cleaned_data.get("username")
        if username is not None and signin_refused(self.request, username):
            minutes = -(-settings.LOGIN_FAILURE_WINDOW_S // 60)
            raise forms.ValidationError(
                f"Too many failed sign-ins from this address; try again in {minutes} minutes.",
                code=THROTTLED,
            )
        return super().clean()


class SignInForm(ThrottledSignInMixin, AuthenticationForm):
    pass


class AdminSignInForm(ThrottledSignInMixin, AdminAuthenticationForm):
    pass


YOURSELF = ""


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for, e.g. “nightly eval CI”.")
    owner = forms.ChoiceField(required=False, label="For")
    scopes = forms.MultipleChoiceField(
        choices=TokenScope.choices,
        initial=[TokenScope.SUBMIT],
        widget=forms.CheckboxSelectMultiple,
        help_text="admin implies submit, which implies read.",
    )
    expires_in_days = forms.IntegerField(
        min_value=1,
        max_value=3650,
        required=False,
        label="Expires in (days)",
        help_text="Empty: until revoked.",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        self.accounts = {str(a.pk): a for a in service_accounts_managed_by(user=user)}
        self.fields["owner"].choices = [(YOURSELF, f"Yourself ({user.get_username()})")] + [
            (pk, f"Service account {a.team.slug}/{a.name}") for pk, a in self.accounts.items()
        ]

    def owner_user(self):
        account = self.accounts.get(self.cleaned_data["owner"])
        return account.user if account is not None else self.user

    def expires_at(self) -> dt.datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + dt.timedelta(days=days) if days else None
