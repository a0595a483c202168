"""Pages: signing in, and API tokens (yours, and your teams' service accounts'), for cpctl
and CI."""

from pathlib import Path

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.core.exceptions import NON_FIELD_ERRORS
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts import selectors, services
from apps.accounts.forms import THROTTLED, SignInForm, TokenForm
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response


class SignInView(LoginView):
    """Django's login page; a sign-in refused by the throttle answers 429."""

    authentication_form = SignInForm

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["demo_logins"] = demo_logins_shown()
        return context

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.has_error(NON_FIELD_ERRORS, THROTTLED):
            response.status_code = 429
            response["Retry-After"] = str(settings.LOGIN_FAILURE_WINDOW_S)
        return response


def demo_logins_shown() -> str:
    """Where the demo's passwords are, for the login page to say: only under DEBUG (`make
    run`) with the demo fleet loaded; "" otherwise."""
    path = Path(settings.DEMO_LOGINS_PATH)
    if not settings.DEBUG or not path.exists():
        return ""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@login_required
def tokens(request):
    """List and make tokens. A new token's secret is in this answer only (never stored, never
    put in the session): the page says to copy it now."""
    form = TokenForm(request.POST or None, user=request.user)
    created = None
    if request.method == "POST" and form.is_valid():
        try:
            token, secret = services.api_token_create(
                user=form.owner_user(),
                name=form.cleaned_data["name"],
                scopes=form.cleaned_data["scopes"],
                expires_at=form.expires_at(),
                by=request.user,
            )
        except ApplicationError as exc:
            form.add_error(None, exc.message)
        else:
            created = {"token": token, "secret": secret}
            form = TokenForm(user=request.user)
    rows = selectors.tokens_visible_to(user=request.user).order_by("-created_at", "-id")
    response = render(
        request,
        "accounts/tokens.html",
        {
            "form": form,
            "created": created,
            "tokens": rows,
            "api_url": request.build_absolute_uri("/"),
            "now": timezone.now(),
        },
        status=201 if created else 200,
    )
    response["Cache-Control"] = "no-store"  # a secret may be on it
    return response


TOKEN_COLUMNS = [
    "id",
    "name",
    "owner",
    "prefix",
    "scopes",
    "created_at",
    "last_used_at",
    "expires_at",
    "revoked_at",
]


@login_required
def tokens_csv(request):
    """The tokens on the page, for an audit: names, owners, prefixes and dates, no secrets."""
    rows = selectors.tokens_visible_to(user=request.user).order_by("-created_at", "-id")
    return csv_response(
        "tokens.csv",
        TOKEN_COLUMNS,
        (
            [
                t.pk,
                t.name,
                t.user.get_username(),
                t.prefix,
                " ".join(t.scopes),
                t.created_at,
                t.last_used_at or "",
                t.expires_at or "",
                t.revoked_at or "",
            ]
            for t in rows
        ),
    )


@login_required
@require_POST
def token_revoke(request, token_id: int):
    token = get_object_or_404(selectors.tokens_visible_to(user=request.user), pk=token_id)
    try:
        services.api_token_revoke(token=token, by=request.user)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Token {token.name} ({token.prefix}…) revoked.")
    return redirect("accounts:tokens")
