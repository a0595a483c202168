"""Settings come from the environment, with safe defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import json, django; from django.conf import settings; django.setup(); "
    "print(json.dumps({'debug': settings.DEBUG, 'secure': settings.SESSION_COOKIE_SECURE, "
    "'csrf_secure': settings.CSRF_COOKIE_SECURE, 'hosts': settings.ALLOWED_HOSTS, "
    "'parsers': settings.REST_FRAMEWORK['DEFAULT_PARSER_CLASSES'], "
    "'db': settings.DATABASES['default']['ENGINE'], 'broker': settings.CELERY_BROKER_URL, "
    "'cache': settings.CACHES['default']['BACKEND'], "
    "'acks_late': settings.CELERY_TASK_ACKS_LATE, "
    "'reject_on_lost': settings.CELERY_TASK_REJECT_ON_WORKER_LOST, "
    "'hsts': settings.SECURE_HSTS_SECONDS}))"
)


def load_settings(tmp_path, **env):
    clean = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "SECRET_KEY",
            "SECRET_KEY_FILE",
            "DJANGO_DEBUG",
            "DATABASE_URL",
            "REDIS_URL",
            "CELERY_BROKER_URL",
            "ALLOWED_HOSTS",
        )
    }
    clean.update(
        {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "CONTROLPLANE_VAR_DIR": str(tmp_path)},
        **env,
    )
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_a_secret_key_production_settings_refuse_to_start(tmp_path):
    result = load_settings(tmp_path)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


def test_production_defaults_are_safe(tmp_path):
    result = load_settings(tmp_path, SECRET_KEY="x" * 50)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert values["debug"] is False
    assert values["secure"] is True and values["csrf_secure"] is True
    assert values["hosts"] == []
    assert values["parsers"] == ["controlplane.parsers.JSONParser"]  # JSON only
    assert values["acks_late"] is True and values["reject_on_lost"] is True
    assert values["hsts"] == 31536000  # a year of HTTPS only, unless told otherwise
    told = json.loads(load_settings(tmp_path, SECRET_KEY="x" * 50, SECURE_HSTS_SECONDS="0").stdout)
    assert told["hsts"] == 0


def test_embedded_defaults_without_urls(tmp_path):
    values = json.loads(load_settings(tmp_path, SECRET_KEY="x" * 50).stdout)
    assert values["db"] == "django.db.backends.sqlite3"
    assert values["broker"] == "filesystem://"
    assert values["cache"].endswith("DatabaseCache")


def test_urls_select_postgres_and_redis(tmp_path):
    values = json.loads(
        load_settings(
            tmp_path,
            SECRET_KEY="x" * 50,
            DATABASE_URL="postgres://u:p@db.example:5433/cp",
            REDIS_URL="redis://cache.example:6379/2",
        ).stdout
    )
    assert values["db"] == "django.db.backends.postgresql"
    assert values["broker"] == "redis://cache.example:6379/2"
    assert values["cache"].endswith("RedisCache")


def test_development_reads_the_key_file_and_turns_debug_on(tmp_path):
    key = tmp_path / "secret_key"
    key.write_text("k" * 50)
    result = load_settings(tmp_path, DJANGO_DEBUG="1", SECRET_KEY_FILE=str(key), SECURE_COOKIES="0")
    values = json.loads(result.stdout)
    assert values["debug"] is True and values["secure"] is False
    assert "127.0.0.1" in values["hosts"]
    assert values["hsts"] == 0  # plain http on a laptop


@pytest.mark.parametrize("raw", ["maybe", "2"])
def test_a_bad_boolean_is_a_clear_error(tmp_path, raw):
    result = load_settings(tmp_path, SECRET_KEY="x" * 50, DJANGO_DEBUG=raw)
    assert result.returncode != 0
    assert "DJANGO_DEBUG must be a boolean" in result.stderr


@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({"NODE_DOWN_AFTER_S": "8", "NODE_SUSPECT_AFTER_S": "4", "AGENT_HEARTBEAT_S": "1"}, False),
        ({"NODE_DOWN_AFTER_S": "30", "NODE_SUSPECT_AFTER_S": "60"}, False),
        ({"NODE_DOWN_AFTER_S": "12", "NODE_SUSPECT_AFTER_S": "4", "AGENT_HEARTBEAT_S": "1"}, True),
    ],
)
def test_down_must_wait_out_suspect_and_one_slow_heartbeat(tmp_path, env, allowed):
    """DOWN requeues a node's jobs: a threshold one queued heartbeat can cross (or one
    below SUSPECT) refuses to start, naming the settings."""
    result = load_settings(tmp_path, SECRET_KEY="x" * 50, **env)
    if allowed:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert "NODE_DOWN_AFTER_S" in result.stderr and "request timeout" in result.stderr
