"""Settings of the control plane, read from the environment.

Defaults are safe for production (DEBUG off, a SECRET_KEY required, secure
cookies); `make run` sets the development values explicitly.
"""

import hashlib
import hmac
import json
import re
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from controlplane.env import (
    database_from_url,
    env_bool,
    env_int,
    env_list,
    env_str,
    sqlite_database,
)
from workers.agent import VERSION as AGENT_PACKAGE_VERSION
from workers.agent.config import AgentConfig

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("CONTROLPLANE_VAR_DIR", str(BASE_DIR / "var")))
# `manage.py demo_fleet` writes its users' first passwords here; under DEBUG the login page
# says so.
DEMO_LOGINS_PATH = VAR_DIR / "demo-logins.json"

DEBUG = env_bool("DJANGO_DEBUG", False)

SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY and env_str("SECRET_KEY_FILE"):
    SECRET_KEY = Path(env_str("SECRET_KEY_FILE")).read_text().strip()
if not SECRET_KEY:
    raise ImproperlyConfigured(
        "SECRET_KEY (or SECRET_KEY_FILE) must be set; `make run` generates one under var/."
    )

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Behind HTTPS (the default outside DEBUG) cookies travel only over TLS.
SECURE = env_bool("SECURE_COOKIES", not DEBUG)
SESSION_COOKIE_SECURE = SECURE
CSRF_COOKIE_SECURE = SECURE
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# A year of HTTPS only once a browser has seen the site over HTTPS (not on a laptop's http).
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if env_bool("TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "apps.accounts",
    "apps.outbox",
    "apps.fleet",
    "apps.tuning",
    "apps.costs",
    "apps.jobs",
    "apps.checkpoints",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.csp.ContentSecurityPolicyMiddleware",
    "controlplane.observability.RequestMetricsMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "controlplane.badrequests.BadRequestMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "apps.accounts.middleware.RequestContextMiddleware",
    "controlplane.notfound.NotFoundPageMiddleware",
]

if not DEBUG:
    # Serves collected static files from gunicorn, so no separate file server is needed
    # (under DEBUG, runserver serves them from static/).
    MIDDLEWARE.insert(1, "whitenoise.middleware.WhiteNoiseMiddleware")

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.navigation.navigation",
                "apps.costs.context.budget_banners",
            ],
        },
    },
]

# Database: PostgreSQL in production and CI, SQLite under var/ on a laptop.
DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL, base_dir=BASE_DIR)}
else:
    DATABASES = {"default": sqlite_database(VAR_DIR / "controlplane.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis, when given, carries the broker, the cache, locks and heartbeats;
# without it the embedded defaults do the same jobs on one machine.
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "controlplane.cache.SharedClientRedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": env_str("CACHE_KEY_PREFIX", "cp"),
            # A Redis that stops answering (rather than refusing) costs a request at most
            # these seconds; the cache's users then read the database (controlplane/cache.py).
            "OPTIONS": {"socket_connect_timeout": 1.0, "socket_timeout": 2.0},
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.db.DatabaseCache",
            "LOCATION": "controlplane_cache",
        }
    }

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "filesystem://")
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
if CELERY_BROKER_URL.startswith("filesystem://"):
    _queue_dir = VAR_DIR / "broker" / "queue"
    _processed_dir = VAR_DIR / "broker" / "processed"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir),
        "data_folder_out": str(_queue_dir),
        "processed_folder": str(_processed_dir),
        # Broadcast (worker control) messages, kept under var/ with the queue.
        "control_folder": str(VAR_DIR / "broker" / "control"),
        "store_processed": False,
    }
else:
    # A task a worker took but never acknowledged comes back after this long.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT_S", 3600),
    }

# Fleet health: a node whose heartbeats stop is SUSPECT first (never torn down
# on a blip), and DOWN only after the longer threshold.
NODE_SUSPECT_AFTER_S = env_int("NODE_SUSPECT_AFTER_S", 60)
NODE_DOWN_AFTER_S = env_int("NODE_DOWN_AFTER_S", 600)
NODE_SWEEP_EVERY_S = env_int("NODE_SWEEP_EVERY_S", 15)

CELERY_BEAT_SCHEDULE = {
    "fleet-heartbeat-sweep": {
        "task": "fleet.heartbeat_sweep",
        "schedule": float(NODE_SWEEP_EVERY_S),
    },
}

# Node agents: how often they heartbeat, how long a node token's look-up is cached,
# and the health limits past which a node is drained (apps/fleet/agents.py).
AGENT_HEARTBEAT_S = env_int("AGENT_HEARTBEAT_S", 5)
# A DOWN node's jobs are requeued, so DOWN must wait out more than a slow answer: past
# SUSPECT, and past a heartbeat plus an agent's request timeout (its default, unless its
# AGENT_REQUEST_TIMEOUT_S says otherwise), or one heartbeat queued behind a burst of
# requests loses a node that was never gone.
AGENT_REQUEST_TIMEOUT_S = AgentConfig.request_timeout_s
_down_after_more_than = max(NODE_SUSPECT_AFTER_S, AGENT_HEARTBEAT_S + AGENT_REQUEST_TIMEOUT_S)
if _down_after_more_than >= NODE_DOWN_AFTER_S:
    raise ImproperlyConfigured(
        f"NODE_DOWN_AFTER_S ({NODE_DOWN_AFTER_S}) must exceed NODE_SUSPECT_AFTER_S "
        f"({NODE_SUSPECT_AFTER_S}) and AGENT_HEARTBEAT_S ({AGENT_HEARTBEAT_S}) plus an "
        f"agent's request timeout ({AGENT_REQUEST_TIMEOUT_S:g} s)"
    )
# A node whose last written heartbeat is older than this takes no new work (it is not yet
# SUSPECT): one missed heartbeat, on top of the sweep's period (heartbeats reach the
# database only when the sweep flushes them), and a margin for the flush itself.
NODE_QUIET_AFTER_S = env_int("NODE_QUIET_AFTER_S", NODE_SWEEP_EVERY_S + 2 * AGENT_HEARTBEAT_S)
AGENT_VERSION = AGENT_PACKAGE_VERSION  # agents older than the one shipped are upgraded
NODE_TOKEN_CACHE_S = env_int("NODE_TOKEN_CACHE_S", 300)
GPU_MAX_TEMPERATURE_C = env_int("GPU_MAX_TEMPERATURE_C", 90)
NODE_MIN_FREE_DISK_GB = env_int("NODE_MIN_FREE_DISK_GB", 50)
# GPU telemetry (apps/fleet/telemetry.py): each flushed heartbeat's readings are kept for a
# day, their one-minute means for a month; the rollup also deletes what is past these.
TELEMETRY_RAW_RETENTION_S = env_int("TELEMETRY_RAW_RETENTION_S", 24 * 3600)
TELEMETRY_MINUTE_RETENTION_S = env_int("TELEMETRY_MINUTE_RETENTION_S", 30 * 24 * 3600)
TELEMETRY_ROLLUP_EVERY_S = env_int("TELEMETRY_ROLLUP_EVERY_S", 60)
CELERY_BEAT_SCHEDULE["fleet-telemetry-rollup"] = {
    "task": "fleet.telemetry_rollup",
    "schedule": float(TELEMETRY_ROLLUP_EVERY_S),
}
# Fabric health (apps/fleet/fabric.py): a link whose error counter rises faster than its
# limit (per minute) marks the link and its node fabric-degraded, until every rate has
# stayed within its limit for FABRIC_CLEAR_AFTER_S. Counters not named have no limit.
FABRIC_ERROR_RATE_LIMITS = {
    "link_downed": 0.0,
    "link_error_recovery": 1.0,
    "symbol_error": 10.0,
    "port_rcv_errors": 10.0,
    "port_rcv_remote_physical_errors": 10.0,
    "local_link_integrity_errors": 1.0,
    "excessive_buffer_overrun_errors": 1.0,
    "port_xmit_discards": 100.0,
    "rx_drops": 100.0,
    "retrans_timeout_events": 1.0,
    "unresponsive_remote_events": 0.0,
    "impaired_remote_conn_events": 0.0,
    **json.loads(env_str("FABRIC_ERROR_RATE_LIMITS") or "{}"),
}
FABRIC_CLEAR_AFTER_S = env_int("FABRIC_CLEAR_AFTER_S", 600)

# NCCL tuning runs (apps/tuning/runs.py). The adoption rule's confidence (shared among a
# run's candidates, Bonferroni); the preset whose gradient buckets are the sizes that matter
# by default; how often a pool's adopted settings are re-measured (a drift check), and the
# team whose GPU time drift checks are counted to (ops name one; none: no drift checks).
TUNING_CONFIDENCE = float(env_str("TUNING_CONFIDENCE") or "0.95")
TUNING_PRESET = env_str("TUNING_PRESET") or "8b"
TUNING_DRIFT_EVERY_S = env_int("TUNING_DRIFT_EVERY_S", 7 * 86400)
TUNING_DRIFT_TEAM = env_str("TUNING_DRIFT_TEAM")
TUNING_JUDGE_REDRIVE_S = env_int("TUNING_JUDGE_REDRIVE_S", 120)
TUNING_OUTPUT_WAIT_S = env_int("TUNING_OUTPUT_WAIT_S", 60)
CELERY_BEAT_SCHEDULE["tuning-sweep"] = {"task": "tuning.sweep", "schedule": 300.0}
# Where local and SSH nodes' agents watch for spot notices (none: off; AWS nodes get
# the real instance metadata address in their user data).
AGENT_IMDS_URL = env_str("AGENT_IMDS_URL")
AGENT_SPOT_POLL_S = env_int("AGENT_SPOT_POLL_S", 5)

# Node providers: `local` runs nodes as processes on this machine.
NODE_PROVIDER_DEFAULT = env_str("NODE_PROVIDER_DEFAULT", "local")
SSH_KEY_FILE = env_str("SSH_KEY_FILE")
# Node directories on owned hosts: outside any home directory, so the unprivileged users
# the agent runs jobs as can reach their run directories (workers/agent/isolation.py).
SSH_NODE_ROOT = env_str("SSH_NODE_ROOT", "/var/lib/controlplane")
# The Python the agent runs on owned hosts, and so the `python3` of every run it starts (the
# trainer's torchrun): the first on the login PATH, or a path such as /opt/venv/bin/python3
# where torch lives in a virtual environment.
SSH_NODE_PYTHON = env_str("SSH_NODE_PYTHON", "python3")
AWS_REGION = env_str("AWS_REGION", "us-east-1")
AWS_ENDPOINT_URL = env_str("AWS_ENDPOINT_URL")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Passwords are checked by a backend that refuses, before hashing, an address that failed
# LOGIN_FAILURES_PER_USER times for one username or LOGIN_FAILURES_PER_ADDRESS times in all;
# each count is forgotten LOGIN_FAILURE_WINDOW_S after its latest failure.
AUTHENTICATION_BACKENDS = ["apps.accounts.backends.ThrottledModelBackend"]
LOGIN_FAILURES_PER_USER = env_int("LOGIN_FAILURES_PER_USER", 5)
LOGIN_FAILURES_PER_ADDRESS = env_int("LOGIN_FAILURES_PER_ADDRESS", 20)
LOGIN_FAILURE_WINDOW_S = env_int("LOGIN_FAILURE_WINDOW_S", 900)
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "fleet:overview"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "static_collected")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        # Hashed names in production (collectstatic); plain files under DEBUG and tests.
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if env_bool("STATIC_MANIFEST", False)
        else "django.contrib.staticfiles.storage.StaticFilesStorage",
    },
}

REST_FRAMEWORK = {
    "DEFAULT_PARSER_CLASSES": ["controlplane.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.accounts.authentication.ApiTokenAuthentication",
        "apps.accounts.authentication.BrowserSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "apps.accounts.permissions.IsAuthenticatedWithScope",
    ],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "controlplane.schema.Schema",
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "DEFAULT_THROTTLE_CLASSES": [],
}

SPECTACULAR_SETTINGS = {
    "TITLE": "GPU control plane API",
    "DESCRIPTION": (
        "Inventory of owned racks and cloud pools, jobs, checkpoints, costs and NCCL "
        "settings. Authenticate with `Authorization: Bearer <token>` (API tokens) or a "
        'browser session. Errors have one shape: `{"error": {"code", "message", "details"}}`.'
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": r"/api/v1",  # tag operations by resource: nodes, teams...
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "NodeStateEnum": "apps.fleet.models.nodes.NodeState",
        "TeamRoleEnum": "apps.accounts.models.TeamRole",
        "ServiceAccountRoleEnum": "apps.accounts.models.SERVICE_ACCOUNT_ROLES",
        "CheckpointStateEnum": "apps.checkpoints.models.CheckpointState",
        "CheckpointCopyStateEnum": "apps.checkpoints.models.CopyState",
        "CheckpointCopyKindEnum": "apps.checkpoints.models.CopyKind",
        "JobStateEnum": "apps.jobs.models.JobState",
        "JobKindEnum": "apps.jobs.models.JobKind",
        "PriorityClassEnum": "apps.jobs.models.PriorityClass",
        "PlacementEnum": "apps.jobs.models.Placement",
        "GpuTypeEnum": "apps.accounts.models.GPU_TYPES",
        "JobGpuTypeEnum": "apps.jobs.models.jobs.JOB_GPU_TYPES",
        "FabricEnum": "apps.fleet.models.pools.Fabric",
        "TuningRunStateEnum": "apps.tuning.models.TuningRunState",
        "TuningRunKindEnum": "apps.tuning.models.TuningRunKind",
        "VersionSourceEnum": "apps.tuning.models.VersionSource",
    },
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums"],
}

LOG_LEVEL = env_str("LOG_LEVEL", "INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}

# Behind a proxy that sets X-Forwarded-For, the audit log records the client's address.
TRUST_X_FORWARDED_FOR = env_bool("TRUST_X_FORWARDED_FOR", False)

# When set, /metrics asks for `Authorization: Bearer <METRICS_TOKEN>`; unset, a signed-in
# ops user or superuser.
METRICS_TOKEN = env_str("METRICS_TOKEN")

# The scheduler: a pass on a beat, and soon after a submit, finish or cancel, with
# bursts of triggers coalesced into one pass per window.
SCHEDULE_EVERY_S = env_int("SCHEDULE_EVERY_S", 30)
SCHEDULE_COALESCE_S = env_int("SCHEDULE_COALESCE_S", 2)
FAIR_SHARE_HALF_LIFE_S = env_int("FAIR_SHARE_HALF_LIFE_S", 7 * 86400)
BACKFILL_DEPTH = env_int("BACKFILL_DEPTH", 100)
PREEMPTION_GRACE_S = env_int("PREEMPTION_GRACE_S", 300)
# Development only: local nodes, whose agent (not root) cannot run jobs as users of their
# own, may hold several teams' jobs at once, though those jobs can read each other.
LOCAL_JOBS_CAN_READ_EACH_OTHER = env_bool("LOCAL_JOBS_CAN_READ_EACH_OTHER", False)
# How long submission may trust a cached answer to "could any pool ever hold this job?"
CAPACITY_CACHE_S = env_int("CAPACITY_CACHE_S", 10)
# How long an API token's user and roles are answered from the cache (0: never);
# changes to them mark the entry stale at once (apps/accounts/principals.py).
AUTH_CACHE_S = env_int("AUTH_CACHE_S", 60)
CELERY_BEAT_SCHEDULE["jobs-schedule"] = {
    "task": "jobs.schedule",
    "schedule": float(SCHEDULE_EVERY_S),
}
CELERY_BEAT_SCHEDULE["jobs-reconcile"] = {"task": "jobs.reconcile", "schedule": 60.0}
# A placed job whose dispatch was lost is dispatched again this long after its placement,
# by a sweep every half of it: within 1.5 × DISPATCH_REDRIVE_S.
DISPATCH_REDRIVE_S = env_int("DISPATCH_REDRIVE_S", 10)
CELERY_BEAT_SCHEDULE["jobs-redispatch"] = {
    "task": "jobs.redispatch",
    "schedule": DISPATCH_REDRIVE_S / 2,
}
CELERY_BEAT_SCHEDULE["jobs-purge-logs"] = {"task": "jobs.purge_logs", "schedule": 3600.0}

# Dispatch: where agents reach the control plane, the range of rendezvous ports (each
# attempt holds one on its first node that no other job there holds), how long agents have
# to start a job's plans before it is requeued, how long job output is kept, and
# where checkpoints go (shared storage or s3:// in production).
CONTROLPLANE_URL = env_str("CONTROLPLANE_URL", "http://127.0.0.1:8000")
RENDEZVOUS_PORT_BASE = env_int("RENDEZVOUS_PORT_BASE", 29500)
RENDEZVOUS_PORT_SPREAD = env_int("RENDEZVOUS_PORT_SPREAD", 1000)
JOB_START_TIMEOUT_S = env_int("JOB_START_TIMEOUT_S", 900)
LOG_RETENTION_DAYS = env_int("LOG_RETENTION_DAYS", 30)
CHECKPOINT_ROOT = env_str("CHECKPOINT_ROOT", str(VAR_DIR / "checkpoints"))
# Where each node keeps its copies of S3 datasets (apps/jobs/datasets.py): one directory
# per team and dataset, kept across jobs so a dataset already there is not fetched again.
DATASET_CACHE_DIR = env_str("DATASET_CACHE_DIR", "/var/lib/controlplane/datasets")

# Team secrets are encrypted with these Fernet keys (newest first); empty: derived
# from SECRET_KEY. Generate one with
# `python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"`.
SECRETS_ENCRYPTION_KEYS = env_str("SECRETS_ENCRYPTION_KEYS")

# Webhooks: https only, and never to private addresses, unless turned on here
# (the test suite's receiver listens on 127.0.0.1).
WEBHOOK_ALLOW_HTTP = env_bool("WEBHOOK_ALLOW_HTTP", DEBUG)
WEBHOOK_ALLOW_PRIVATE = env_bool("WEBHOOK_ALLOW_PRIVATE", DEBUG)
CELERY_BEAT_SCHEDULE["outbox-deliver"] = {"task": "outbox.deliver", "schedule": 15.0}

# Cloud nodes (AWS). CONTROLPLANE_ID is the value of the `controlplane:id` tag on every
# instance we launch: the orphan sweep takes an instance with our tag and no node in the
# database for ours to report or terminate, so two control planes sharing an AWS account
# must never share it. Unset, it is derived from SECRET_KEY (distinct per deployment and
# stable while the key is); set it explicitly in production, so a key rotation does not
# leave running instances behind an id nobody sweeps any more.
CONTROLPLANE_ID = env_str("CONTROLPLANE_ID") or (
    "cp-" + hmac.new(SECRET_KEY.encode(), b"controlplane-id", hashlib.sha256).hexdigest()[:12]
)
if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", CONTROLPLANE_ID):
    raise ImproperlyConfigured(
        "CONTROLPLANE_ID must be 1 to 63 letters, digits, '.', '_' or '-', starting with "
        f"a letter or digit; got {CONTROLPLANE_ID!r}"
    )
# Where cloud nodes' user data downloads the agent (default: CONTROLPLANE_URL +
# /agent/bundle.tar.gz, served by the control plane itself).
AGENT_BUNDLE_URL = env_str("AGENT_BUNDLE_URL")
# A cloud node not READY this long after it was requested is FAILED (and later terminated);
# a job whose burst nodes failed waits this long before it bursts again.
CLOUD_NODE_BOOT_TIMEOUT_S = env_int("CLOUD_NODE_BOOT_TIMEOUT_S", 1800)
CLOUD_BURST_RETRY_S = env_int("CLOUD_BURST_RETRY_S", 900)
# Requested or provisioning cloud nodes whose task seems lost are re-driven this often.
CLOUD_REDRIVE_AFTER_S = env_int("CLOUD_REDRIVE_AFTER_S", 600)
CLOUD_SWEEP_EVERY_S = env_int("CLOUD_SWEEP_EVERY_S", 60)
ORPHAN_SWEEP_EVERY_S = env_int("ORPHAN_SWEEP_EVERY_S", 600)
CELERY_BEAT_SCHEDULE["fleet-cloud-sweep"] = {
    "task": "fleet.cloud_sweep",
    "schedule": float(CLOUD_SWEEP_EVERY_S),
}
CELERY_BEAT_SCHEDULE["fleet-orphan-sweep"] = {
    "task": "fleet.orphan_sweep",
    "schedule": float(ORPHAN_SWEEP_EVERY_S),
}
# Owned (local, SSH) nodes provisioning or bootstrapping this long are taken up again: the
# task that was doing it was lost. The sweep looks every minute (or every half of a
# shorter threshold).
OWNED_REDRIVE_AFTER_S = env_int("OWNED_REDRIVE_AFTER_S", 300)
CELERY_BEAT_SCHEDULE["fleet-provisioning-redrive"] = {
    "task": "fleet.provisioning_redrive",
    "schedule": min(60.0, OWNED_REDRIVE_AFTER_S / 2),
}

# Costs: every node-second metered into the usage ledger (apps/costs). Days and months
# are counted in COSTS_TIME_ZONE; amounts are in COSTS_CURRENCY (the price book's).
# Idle capacity is shown as its own line ("separate") or spread over the teams in
# proportion to their use ("spread"). Metering stops COSTS_METER_LAG_S short of now, so
# allocations still being written are in; budget states are kept COSTS_BUDGET_CACHE_S.
COSTS_TIME_ZONE = env_str("COSTS_TIME_ZONE", "UTC")
COSTS_CURRENCY = env_str("COSTS_CURRENCY", "USD")
COSTS_IDLE_COST = env_str("COSTS_IDLE_COST", "separate")
if COSTS_IDLE_COST not in ("separate", "spread"):
    raise ImproperlyConfigured(f"COSTS_IDLE_COST is separate or spread, not {COSTS_IDLE_COST!r}")
COSTS_METER_EVERY_S = env_int("COSTS_METER_EVERY_S", 300)
COSTS_METER_LAG_S = env_int("COSTS_METER_LAG_S", 60)
COSTS_SPOT_PRICES_EVERY_S = env_int("COSTS_SPOT_PRICES_EVERY_S", 3600)
COSTS_FORECAST_DAYS = env_int("COSTS_FORECAST_DAYS", 7)
COSTS_BUDGET_CACHE_S = env_int("COSTS_BUDGET_CACHE_S", 5)
CELERY_BEAT_SCHEDULE["costs-meter"] = {
    "task": "costs.meter",
    "schedule": float(COSTS_METER_EVERY_S),
}
CELERY_BEAT_SCHEDULE["costs-spot-prices"] = {
    "task": "costs.spot_prices",
    "schedule": float(COSTS_SPOT_PRICES_EVERY_S),
}

# Checkpoints (apps/checkpoints). CHECKPOINT_ROOT_SHARED: every node mounts CHECKPOINT_ROOT
# (shared storage; local nodes share this machine's disk), so a job resumes anywhere; off,
# each node's checkpoints are its own and a job resumes from them only on that node (or
# from an S3 copy). S3 copies go to CHECKPOINT_S3_BUCKET under CHECKPOINT_S3_PREFIX unless
# a team or pool names its own destination (empty: none); they are checked by reading every
# object ("read") or by their sizes ("size"). Retention keeps the newest
# CHECKPOINT_KEEP_LAST unless a job says otherwise. GC runs every CHECKPOINT_GC_EVERY_S;
# a failed deletion is retried after CHECKPOINT_RETRY_S, doubling; a request no agent
# answered in CHECKPOINT_REQUEST_TIMEOUT_S is asked again (of another node that reaches the
# copy, for shared storage). Dispatch waits up to CHECKPOINT_RESUME_WAIT_S for the new nodes
# to list the job's directory and check newer checkpoints before choosing one. An export to
# Hugging Face may run CHECKPOINT_EXPORT_TIMEOUT_S on its node; one unanswered after twice
# that (or whose node stopped answering) fails, and can be asked again.
CHECKPOINT_ROOT_SHARED = env_bool("CHECKPOINT_ROOT_SHARED", True)
CHECKPOINT_S3_BUCKET = env_str("CHECKPOINT_S3_BUCKET")
CHECKPOINT_S3_PREFIX = env_str("CHECKPOINT_S3_PREFIX", "checkpoints")
CHECKPOINT_S3_VERIFY = env_str("CHECKPOINT_S3_VERIFY", "read")
if CHECKPOINT_S3_VERIFY not in ("read", "size"):
    raise ImproperlyConfigured(f"CHECKPOINT_S3_VERIFY: read or size, not {CHECKPOINT_S3_VERIFY!r}")
CHECKPOINT_KEEP_LAST = env_int("CHECKPOINT_KEEP_LAST", 3)
CHECKPOINT_GC_EVERY_S = env_int("CHECKPOINT_GC_EVERY_S", 60)
CHECKPOINT_RETRY_S = env_int("CHECKPOINT_RETRY_S", 30)
CHECKPOINT_REQUEST_TIMEOUT_S = env_int("CHECKPOINT_REQUEST_TIMEOUT_S", 900)
CHECKPOINT_RESUME_WAIT_S = env_int("CHECKPOINT_RESUME_WAIT_S", 120)
CHECKPOINT_EXPORT_TIMEOUT_S = env_int("CHECKPOINT_EXPORT_TIMEOUT_S", 4 * 3600)
CHECKPOINT_SWEEP_FINISHED_DAYS = env_int("CHECKPOINT_SWEEP_FINISHED_DAYS", 7)
CELERY_BEAT_SCHEDULE["checkpoints-collect"] = {
    "task": "checkpoints.collect",
    "schedule": float(CHECKPOINT_GC_EVERY_S),
}
CELERY_BEAT_SCHEDULE["checkpoints-verify-s3"] = {
    "task": "checkpoints.verify_s3",
    "schedule": float(CHECKPOINT_GC_EVERY_S),
}
