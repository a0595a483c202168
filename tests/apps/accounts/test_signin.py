"""Password sign-in is throttled per username and address, and per address, before any
password is hashed: guessing is capped, and refused guesses cost no PBKDF2."""

import pytest
from django.contrib.auth.hashers import MD5PasswordHasher

from tests import factories

pytestmark = pytest.mark.django_db


class CountingHasher(MD5PasswordHasher):
    """The test suite's hasher, counting how often a password is hashed."""

    hashed = 0

    def encode(self, password, salt):
        type(self).hashed += 1
        return super().encode(password, salt)


@pytest.fixture
def hashes(settings):
    settings.PASSWORD_HASHERS = [f"{__name__}.CountingHasher"]
    settings.LOGIN_FAILURES_PER_USER = 5
    settings.LOGIN_FAILURES_PER_ADDRESS = 20
    CountingHasher.hashed = 0
    return CountingHasher


def sign_in(client, username, password, address="203.0.113.7", **headers):
    return client.post(
        "/login/", {"username": username, "password": password}, REMOTE_ADDR=address, **headers
    )


def test_sixty_wrong_passwords_then_the_right_one_is_refused_without_hashing(
    client, researcher, hashes
):
    for _ in range(60):
        assert sign_in(client, researcher.username, "guess").status_code in (200, 429)
    assert hashes.hashed == 5  # the five failures allowed; every later try was refused first
    refused = sign_in(client, researcher.username, factories.PASSWORD)
    assert refused.status_code == 429
    assert "Too many failed sign-ins" in refused.content.decode()
    assert int(refused["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session
    assert hashes.hashed == 5
    # Another address is not held back by this one's failures.
    assert sign_in(client, researcher.username, factories.PASSWORD, "198.51.100.9").status_code == (
        302
    )


def test_an_address_guessing_many_usernames_is_refused(client, researcher, hashes):
    for n in range(20):
        sign_in(client, f"nobody{n}", "guess")
    refused = sign_in(client, researcher.username, factories.PASSWORD)
    assert refused.status_code == 429
    assert hashes.hashed == 20


def test_a_success_clears_the_usernames_count(client, researcher, hashes):
    for _ in range(4):
        sign_in(client, researcher.username, "guess")
    assert sign_in(client, researcher.username, factories.PASSWORD).status_code == 302
    client.logout()
    for _ in range(4):
        assert sign_in(client, researcher.username, "guess").status_code == 200
    assert sign_in(client, researcher.username, factories.PASSWORD).status_code == 302


def test_the_admin_login_is_throttled_too(client, hashes):
    root = factories.make_user(username="root", is_superuser=True, is_staff=True)
    for _ in range(5):
        sign_in_admin = client.post(
            "/admin/login/", {"username": "root", "password": "guess"}, REMOTE_ADDR="203.0.113.7"
        )
        assert sign_in_admin.status_code == 200
    hashed = hashes.hashed
    refused = client.post(
        "/admin/login/",
        {"username": root.username, "password": factories.PASSWORD},
        REMOTE_ADDR="203.0.113.7",
    )
    assert refused.status_code == 200  # the admin's own page, with the reason as its error
    assert "Too many failed sign-ins" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    assert hashes.hashed == hashed


def test_behind_a_proxy_the_address_is_the_one_the_proxy_saw(client, researcher, hashes, settings):
    settings.TRUST_X_FORWARDED_FOR = True
    # The client writes what it likes before the proxy's entry; the proxy's entry counts.
    for n in range(5):
        sign_in(
            client,
            researcher.username,
            "guess",
            "10.0.0.2",
            HTTP_X_FORWARDED_FOR=f"192.0.2.{n}, 203.0.113.50",
        )
    refused = sign_in(
        client,
        researcher.username,
        factories.PASSWORD,
        "10.0.0.2",
        HTTP_X_FORWARDED_FOR="192.0.2.99, 203.0.113.50",
    )
    assert refused.status_code == 429
    other_client = sign_in(
        client,
        researcher.username,
        factories.PASSWORD,
        "10.0.0.2",
        HTTP_X_FORWARDED_FOR="203.0.113.51",
    )
    assert other_client.status_code == 302


def test_the_login_page_says_where_the_demo_passwords_are_only_under_make_run(
    client, settings, tmp_path
):
    settings.DEMO_LOGINS_PATH = tmp_path / "demo-logins.json"
    settings.DEBUG = True
    assert "demo-logins.json" not in client.get("/login/").content.decode()  # no demo fleet

    settings.DEMO_LOGINS_PATH.write_text('{"alice": "s3cret-demo-pw"}')
    html = client.get("/login/").content.decode()
    assert f"<code>{settings.DEMO_LOGINS_PATH}</code>" in html
    assert "s3cret-demo-pw" not in html  # where they are, never what they are

    settings.DEBUG = False  # a real deployment never mentions them
    assert "demo-logins.json" not in client.get("/login/").content.decode()
