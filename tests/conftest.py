"""Fixtures every test layer shares: users per role, API clients, the live browser."""

import os

import pytest
from django.conf import settings
from django.core.management import call_command
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from apps.accounts import services as accounts
from apps.accounts.models import OrgRoleName, TeamRole
from tests import factories
from tests.report_backends import describe

# The sshd fixtures: the SSH provider's tests and the end-to-end ones both start one.
pytest_plugins = ["tests.sshd"]
# The fault drills run apart, against a stack of their own (`make drills`).
collect_ignore = ["drills"]

hypothesis_settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
hypothesis_settings.register_profile("dev", max_examples=25, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def pytest_report_header(config):
    return describe()


def _on_postgres() -> bool:
    return settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


def pytest_collection_modifyitems(config, items):
    skip_pg = pytest.mark.skip(reason="needs PostgreSQL: DATABASE_URL is not set")
    skip_redis = pytest.mark.skip(reason="needs Redis: REDIS_URL is not set")
    for item in items:
        if "postgres" in item.keywords and not _on_postgres():
            item.add_marker(skip_pg)
        if "redis" in item.keywords and not settings.REDIS_URL:
            item.add_marker(skip_redis)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """The database cache (used when Redis is absent) needs its table in the test database."""
    with django_db_blocker.unblock():
        call_command("createcachetable", verbosity=0)


@pytest.fixture(autouse=True)
def _fresh_cache():
    from django.core.cache import cache

    yield
    if settings.REDIS_URL:
        cache.clear()


# --- people ---------------------------------------------------------------------------


@pytest.fixture
def team(db):
    return factories.make_team(slug="alpha")


@pytest.fixture
def other_team(db):
    return factories.make_team(slug="beta")


@pytest.fixture
def superuser(db):
    return factories.make_user(username="root", is_superuser=True, is_staff=True)


@pytest.fixture
def ops_user(db):
    return factories.make_org_user(role=OrgRoleName.OPS)


@pytest.fixture
def finance_user(db):
    return factories.make_org_user(role=OrgRoleName.FINANCE)


@pytest.fixture
def team_admin(team):
    return factories.make_member(team=team, role=TeamRole.ADMIN)


@pytest.fixture
def researcher(team):
    return factories.make_member(team=team, role=TeamRole.RESEARCHER)


@pytest.fixture
def viewer(team):
    return factories.make_member(team=team, role=TeamRole.VIEWER)


@pytest.fixture
def user_for_role(team, db):
    """`user_for_role("researcher")` → a user with that role (team roles in `team`)."""

    def make(role: str):
        if role == "superuser":
            return factories.make_user(is_superuser=True, is_staff=True)
        if role in OrgRoleName.values:
            return factories.make_org_user(role=role)
        return factories.make_member(team=team, role=role)

    return make


# --- API clients ----------------------------------------------------------------------


def token_client(user, scopes=("admin",)) -> APIClient:
    """An API client that authenticates for real, with a bearer token of `user`."""
    _, secret = accounts.api_token_create(user=user, name="test", scopes=list(scopes), by=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.user = user
    return client


@pytest.fixture
def api_for():
    """`api_for(user, scopes=("read",))` → an authenticated APIClient."""
    return token_client


@pytest.fixture
def anon_api():
    return APIClient()


# --- the browser ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """Debian's chromium, headless, with no network calls of its own (no Playwright download)."""
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "headless": True,
        "args": CHROMIUM_FLAGS,
    }


@pytest.fixture
def browser_login(live_server):
    """Log `page` in through the real login form; returns the live server's base URL."""

    def login(page, user, password=factories.PASSWORD) -> str:
        page.goto(f"{live_server.url}/login/")
        page.fill("#id_username", user.get_username())
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_load_state("networkidle")
        return live_server.url

    return login
