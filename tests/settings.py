"""Test settings: the production settings, with a fixed key and a scratch var/ folder.

DATABASE_URL and REDIS_URL, when set (as .ci/run sets them), point the tests at
real PostgreSQL and Redis; without them they run on SQLite and the filesystem broker.
"""

import os
import tempfile

os.environ.setdefault("SECRET_KEY", "test-only-key-never-used-outside-the-test-suite-0123456789")
os.environ.setdefault("CONTROLPLANE_VAR_DIR", tempfile.mkdtemp(prefix="controlplane-test-"))
os.environ.setdefault("CACHE_KEY_PREFIX", f"cp-test-{os.getpid()}")
# Playwright's sync API runs an event loop in the test thread; Django must allow ORM calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

from controlplane.settings import *  # noqa: F403

# WhiteNoise serves from here outside DEBUG; the suite does not collect static files.
STATIC_ROOT = VAR_DIR / "static"  # noqa: F405
STATIC_ROOT.mkdir(parents=True, exist_ok=True)

# Fast hashing for the many users tests make; production keeps Django's default.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# 4xx answers are what many tests ask for; keep their warnings out of the output.
LOGGING["loggers"]["django.request"] = {"level": "ERROR"}  # noqa: F405
