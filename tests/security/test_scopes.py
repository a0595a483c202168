"""The scope table: every API route and method, who may call it and with which token scope,
checked against the URL conf (a new endpoint fails until it is classified here) and then
asked for real, as every role, with tokens of each scope and with a browser session.

The policy below is written from README.md ("Roles and access", "The API") and the
services' role checks, not read back from the code: where they disagree, the table says
what is right and the test fails.
"""

import datetime as dt
import json
from dataclasses import dataclass

import pytest
from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.urls import URLResolver, get_resolver, reverse
from django.utils import timezone
from rest_framework.test import APIClient

from apps.accounts.models import ApiToken, AuditEvent, Membership
from apps.jobs.models import Job
from tests.apps.jobs.conftest import trainer_spec
from tests.security.conftest import (
    ANON,
    FINANCE,
    OPS,
    ORG_ROLES,
    RESEARCHER,
    SCOPES,
    SERVICE,
    SIGNED_IN,
    SUPER,
    TEAM_ADMIN,
    TEAM_ROLES,
    TEAMED,
    VIEWER,
)

pytestmark = pytest.mark.django_db  # each test in a savepoint of the module's world

READ, SUBMIT, ADMIN = SCOPES
PUBLIC = "public"  # no credentials needed
NODE = "node"  # node agents' endpoints: node tokens only
METRICS = "metrics"  # Prometheus: ops by session, or METRICS_TOKEN (no API token)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class Rule:
    """Who may make one request: `scope`, the least token scope; `allow`, the roles that may
    do it (team roles on their own team's objects only: another team's is not theirs).
    Whoever is not in `see` (`see_other`, for another team's object) does not see the
    object: 404, not 403, so its existence is not revealed."""

    scope: str
    allow: frozenset = SIGNED_IN
    see: frozenset = SIGNED_IN
    see_other: frozenset = ORG_ROLES

    def __post_init__(self):
        # The organisation roles are in no team: every team's object is another's to them.
        assert self.see & ORG_ROLES == self.see_other & ORG_ROLES

    def outcome(self, role: str, target: str | None) -> str:
        """ "ok", "denied" (403) or "hidden" (404) for a role with enough scope."""
        see = self.see_other if target == "other" else self.see
        if target is not None and role not in see:
            return "hidden"
        allow = self.allow & ORG_ROLES if target == "other" else self.allow
        return "ok" if role in allow else "denied"


def read(see=SIGNED_IN, see_other=ORG_ROLES) -> Rule:
    return Rule(READ, allow=see, see=see, see_other=see_other)


def write(scope, *roles, see=SIGNED_IN, see_other=ORG_ROLES) -> Rule:
    return Rule(scope, allow=frozenset(roles), see=see, see_other=see_other)


def crud(
    basename, *writers, see=SIGNED_IN, see_other=ORG_ROLES, methods=("POST", "PATCH", "DELETE")
):
    """A list and a detail route: everyone who sees reads; `writers` write."""
    rules = {
        (f"{basename}-list", "GET"): read(),
        (f"{basename}-detail", "GET"): read(see, see_other),
    }
    for method in methods:
        name = f"{basename}-list" if method == "POST" else f"{basename}-detail"
        rules[name, method] = write(ADMIN, *writers, see=see, see_other=see_other)
    return rules


def read_only(basename, see=SIGNED_IN, see_other=ORG_ROLES):
    return crud(basename, see=see, see_other=see_other, methods=())


OPS_ = (OPS, SUPER)  # "only ops change" the fleet (and NCCL profiles, S3 destinations)
FINANCE_ = (FINANCE, SUPER)  # "finance writes only budgets and prices"
TEAM_ADMIN_ = (TEAM_ADMIN, SUPER)  # "admin (members, service accounts, the team's tokens)"
SUBMITTERS = (RESEARCHER, TEAM_ADMIN, SERVICE, SUPER)  # the service account is a researcher
# Cancel, hold, release, requeue, and a job's checkpoints: the submitter (the researcher
# submitted the own team's job), the team's admins, and ops.
JOB_MANAGERS = (RESEARCHER, TEAM_ADMIN, OPS, SUPER)
EVERYONE = tuple(SIGNED_IN)

POLICY: dict[tuple[str, str], Rule] = {
    # --- accounts ---------------------------------------------------------------------
    ("me", "GET"): read(),
    ("team-list", "GET"): read(),
    ("team-list", "POST"): write(ADMIN, *OPS_),
    ("team-detail", "GET"): read(),
    ("team-detail", "PATCH"): write(ADMIN, *TEAM_ADMIN_),
    ("team-detail", "DELETE"): write(ADMIN, *OPS_),
    **crud("team-quota", *OPS_),  # ops set quotas
    **crud("membership", *TEAM_ADMIN_),
    # Service accounts are seen by their team and by ops (finance has no use for them).
    **crud(
        "service-account",
        *TEAM_ADMIN_,
        see=TEAM_ROLES | set(OPS_),
        see_other=frozenset(OPS_),
        methods=("POST", "DELETE"),
    ),
    # Tokens: your own, and the service accounts' of teams you administer. The target is
    # a service account's token; anyone makes their own token (with the admin scope).
    ("token-list", "GET"): read(),
    ("token-list", "POST"): write(ADMIN, *EVERYONE),
    ("token-detail", "GET"): read(frozenset(TEAM_ADMIN_), frozenset({SUPER})),
    ("token-detail", "DELETE"): write(
        ADMIN, *TEAM_ADMIN_, see=frozenset(TEAM_ADMIN_), see_other=frozenset({SUPER})
    ),
    # The audit log: ops all, team admins their team's (a list of none for the rest).
    **read_only("audit-event", frozenset({TEAM_ADMIN, OPS, SUPER}), frozenset({OPS, SUPER})),
    # Secrets' names: the team's members; their values are never returned.
    **crud("team-secret", *TEAM_ADMIN_, see=TEAM_ROLES | {SUPER}, see_other=frozenset({SUPER})),
    # --- the fleet: everyone signed in reads it; only ops change it --------------------
    **crud("site", *OPS_),
    **crud("rack", *OPS_),
    **crud("instance-type", *OPS_),
    **crud("pool", *OPS_),
    **crud("node", *OPS_),
    ("node-drain", "POST"): write(ADMIN, *OPS_),
    ("node-undrain", "POST"): write(ADMIN, *OPS_),
    ("node-accept-host-key", "POST"): write(ADMIN, *OPS_),
    ("node-provision", "POST"): write(ADMIN, *OPS_),
    ("node-telemetry", "GET"): read(),
    **crud("gpu", *OPS_),
    **read_only("node-event"),
    **read_only("orphan-instance"),
    **crud("reservation", *OPS_, methods=("POST", "DELETE")),
    # --- jobs ---------------------------------------------------------------------------
    ("job-list", "GET"): read(),
    ("job-list", "POST"): write(SUBMIT, *SUBMITTERS),
    # Nothing is written: whoever sees the team may ask, with a token that may submit.
    ("job-estimate", "POST"): write(SUBMIT, *EVERYONE),
    ("job-detail", "GET"): read(),
    ("job-logs", "GET"): read(),
    ("job-evaluations", "GET"): read(),
    ("job-cancel", "POST"): write(SUBMIT, *JOB_MANAGERS),
    ("job-hold", "POST"): write(SUBMIT, *JOB_MANAGERS),
    ("job-release", "POST"): write(SUBMIT, *JOB_MANAGERS),
    ("job-requeue", "POST"): write(SUBMIT, *JOB_MANAGERS),
    ("queue", "GET"): read(),
    # Team webhooks: the team's admins, with the admin scope (a submit token is CI's).
    **crud(
        "webhook",
        *TEAM_ADMIN_,
        see=TEAM_ROLES | {OPS, SUPER},
        see_other=frozenset(OPS_),
        methods=("POST", "DELETE"),
    ),
    # Datasets: the team's members read them, ops every team's; its admins and researchers
    # register and remove them with a submit token (CI that prepares data registers it).
    ("dataset-list", "GET"): read(),
    ("dataset-list", "POST"): write(SUBMIT, *SUBMITTERS),
    ("dataset-detail", "GET"): read(TEAM_ROLES | {OPS, SUPER}, frozenset(OPS_)),
    ("dataset-detail", "DELETE"): write(
        SUBMIT,
        RESEARCHER,
        TEAM_ADMIN,
        SERVICE,
        SUPER,
        see=TEAM_ROLES | {OPS, SUPER},
        see_other=frozenset(OPS_),
    ),
    # --- NCCL settings ----------------------------------------------------------------
    **crud("nccl-profile", *OPS_),
    ("nccl-profile-versions", "GET"): read(),
    ("nccl-profile-version-restore", "POST"): write(ADMIN, *OPS_),
    # Tuning runs: everyone reads them (their figures choose every job's NCCL settings);
    # starting, adopting, declining and cancelling one are ops' actions on the fleet, with
    # the scope ops' other node actions take (drain).
    ("tuning-run-list", "GET"): read(),
    ("tuning-run-list", "POST"): write(ADMIN, *OPS_),
    ("tuning-run-detail", "GET"): read(),
    ("tuning-run-figures", "GET"): read(),
    ("tuning-run-adopt", "POST"): write(ADMIN, *OPS_),
    ("tuning-run-decline", "POST"): write(ADMIN, *OPS_),
    ("tuning-run-cancel", "POST"): write(ADMIN, *OPS_),
    ("nccl-lint", "POST"): write(READ, *EVERYONE),  # "a read token is enough"
    ("nccl-variables", "GET"): read(),
    # --- costs --------------------------------------------------------------------------
    ("spend", "GET"): read(),
    ("spend-daily", "GET"): read(),
    ("spend-top-jobs", "GET"): read(),
    **crud("owned-price", *FINANCE_),
    **crud("cloud-price", *FINANCE_),
    **crud("pool-discount", *FINANCE_),
    **read_only("spot-price"),
    **read_only("usage"),
    ("usage-correct", "POST"): write(ADMIN, *FINANCE_),
    # "finance sets any team's monthly budget, team admins their own"
    **crud("budget", TEAM_ADMIN, *FINANCE_),
    **read_only("budget-alert"),
    # --- checkpoints --------------------------------------------------------------------
    ("checkpoint-storage", "GET"): read(),
    ("checkpoint-list", "GET"): read(),
    ("checkpoint-detail", "GET"): read(),
    # Deleting checkpoints is no job submission: the admin scope (README: `submit` submits
    # and cancels jobs). Asking for a check again is a write like any other.
    ("checkpoint-detail", "DELETE"): write(ADMIN, *JOB_MANAGERS),
    ("checkpoint-verify", "POST"): write(ADMIN, *JOB_MANAGERS),
    # An export writes a new directory beside the checkpoint (nothing is lost): the team's
    # researchers and admins, as a submission, and ops.
    ("checkpoint-export", "POST"): write(SUBMIT, *SUBMITTERS, OPS),
    **read_only("checkpoint-copy"),
    ("checkpoint-copy-detail", "DELETE"): write(ADMIN, *JOB_MANAGERS),
    **read_only("checkpoint-job"),
    # Where a team's checkpoints can be read: its members, ops and finance (pools': org roles).
    **crud("checkpoint-s3-destination", *OPS_, see=TEAM_ROLES | ORG_ROLES),
    # --- node agents: node tokens only --------------------------------------------------
    ("agent-register", "POST"): Rule(NODE),
    ("agent-heartbeat", "POST"): Rule(NODE),
    ("agent-work", "GET"): Rule(NODE),
    ("agent-run-status", "POST"): Rule(NODE),
    ("agent-run-logs", "POST"): Rule(NODE),
    ("agent-events", "POST"): Rule(NODE),
    ("agent-checkpoint-events", "POST"): Rule(NODE),
    ("agent-checkpoint-work", "GET"): Rule(NODE),
    ("agent-checkpoint-verification", "POST"): Rule(NODE),
    ("agent-checkpoint-deletion", "POST"): Rule(NODE),
    ("agent-checkpoint-sweep", "POST"): Rule(NODE),
    ("agent-checkpoint-export", "POST"): Rule(NODE),
    # --- public -------------------------------------------------------------------------
    ("api-schema", "GET"): Rule(PUBLIC),
    ("api-docs", "GET"): Rule(PUBLIC),
    ("agent-bundle", "GET"): Rule(PUBLIC),  # code only, no secrets (controlplane/urls.py)
    ("healthz", "GET"): Rule(PUBLIC),
    # Ops only, by session; with METRICS_TOKEN set, that token only (test_metrics_*).
    ("metrics", "GET"): Rule(METRICS),
}

# --- the URL conf ---------------------------------------------------------------------------

# Pages (each app's, in its namespace, and the admin's) are not the API, nor are these.
PAGES = {None, "login", "logout"}  # the front page's redirect and the login form


@dataclass(frozen=True)
class Route:
    name: str
    callback: object
    args: tuple  # the URL's keyword arguments

    @property
    def view_class(self):
        return getattr(self.callback, "cls", None)

    @property
    def basename(self) -> str | None:
        return getattr(self.callback, "initkwargs", {}).get("basename")

    @property
    def detail(self) -> bool:
        return "pk" in self.args

    def declared_methods(self) -> set[str] | None:
        """What DRF routes to (None for a plain Django view: ask it, see `probe`)."""
        cls = self.view_class
        if cls is None:
            return None
        allowed = {m.upper() for m in cls.http_method_names} & set(METHODS)
        actions = getattr(self.callback, "actions", None)
        if actions:
            return {m.upper() for m in actions} & allowed
        return {m for m in allowed if hasattr(cls, m.lower())}


def _walk(resolver, prefix="", namespace=None):
    for entry in resolver.url_patterns:
        path = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _walk(entry, path, entry.namespace or namespace)
        else:
            yield path, namespace, entry


def _routes() -> dict[str, Route]:
    routes = {}
    for path, namespace, pattern in _walk(get_resolver()):
        api = path.startswith("api/")
        if not api and (namespace is not None or pattern.name in PAGES):
            continue
        assert pattern.name not in routes, f"two API routes named {pattern.name}"
        args = tuple(pattern.pattern.regex.groupindex)
        routes[pattern.name] = Route(pattern.name, pattern.callback, args)
    return routes


ROUTES = _routes()


# URL arguments other than an object's id, naming the world's objects (tests/security/conftest.py).
NAMED = {"name": "sec-custom", "number": 1}


def url(route: str, pk=None) -> str:
    args = ROUTES[route].args
    kwargs = {arg: NAMED.get(arg, pk or 1) for arg in args}
    return reverse(route, kwargs=kwargs) if args else reverse(route)


def test_every_route_and_method_is_in_the_table(client, world):
    """A new endpoint (or method) fails here until the policy above classifies it."""
    served = set()
    for name, route in ROUTES.items():
        methods = route.declared_methods()
        if methods is None:  # a plain view: a method it does not serve is a 405
            methods = {m for m in METHODS if client.generic(m, url(name)).status_code != 405}
        served |= {(name, method) for method in methods}
    assert served - POLICY.keys() == set(), "served but not in the table"
    assert POLICY.keys() - served == set(), "in the table but not served"


# --- asking as every role -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    route: str
    method: str
    target: str | None  # "own" (the team roles' team), "other", or None (no object)
    role: str
    credential: str  # a token's scope, "session", or "none"

    def __str__(self) -> str:
        where = f"-{self.target}" if self.target else ""
        return f"{self.method}-{self.route}{where}-{self.role}-{self.credential}"


def _rank(scope: str) -> int:
    return SCOPES.index(scope)


def _cases(route: str, method: str):
    rule = POLICY[route, method]
    targets = (None,)
    if ROUTES[route].detail:
        targets = ("own", "other") if ROUTES[route].basename in TEAMED else ("own",)
    yield Case(route, method, targets[0], ANON, "none")
    for role in sorted(SIGNED_IN):
        # A read needs the read scope, which the others imply (test_every_scope_reads).
        scopes = (READ,) if method == "GET" else SCOPES
        credentials = [*scopes, *(() if role == SERVICE else ("session",))]
        for credential in credentials:
            below = credential in SCOPES and _rank(credential) < _rank(rule.scope)
            # A scope too low is refused before the object is looked up: one target.
            for target in targets[:1] if below else targets:
                yield Case(route, method, target, role, credential)


def _bodies(world) -> dict:
    """A valid body for every write (so that a refusal is the permission's, not the
    serializer's), for the own team."""
    alpha, now = world.alpha.pk, timezone.now()
    ids = world.ids
    return {
        "team-list": {"name": "Gamma", "slug": "sec-gamma"},
        "team-quota-list": {"team": alpha, "gpu_type": "A100", "max_gpus": 8},
        "membership-list": {"team": alpha, "user": ids["outsider"], "role": "viewer"},
        "service-account-list": {"team": alpha, "name": "ci-new"},
        "token-list": {"name": "new", "scopes": ["read"]},
        "team-secret-list": {"team": alpha, "name": "WANDB_KEY", "value": "secret"},
        "site-list": {"name": "Site Z", "slug": "sec-site-z"},
        "rack-list": {"site": ids["site"], "name": "Z9", "power_budget_kw": "10.00"},
        "instance-type-list": {
            "name": "z1.sec",
            "gpu_type": "H100",
            "gpu_count": 8,
            "gpu_memory_gib": 80,
            "vcpus": 96,
            "memory_gib": 1024,
            "network_gbps": 400,
            "source": "https://example.com/z1",
        },
        "pool-list": {"name": "pz", "slug": "sec-pz", "kind": "owned", "gpu_type": "H100"},
        "node-list": {
            "name": "sec-new",
            "pool": ids["pool"],
            "provider": "local",
            "capacity_type": "owned",
            "gpu_count": 8,
        },
        "gpu-list": {"node": ids["node"], "index": 1},
        "reservation-list": {
            "name": "later",
            "reason": "maintenance",
            "nodes": [ids["node"]],
            "starts_at": (now + dt.timedelta(days=40)).isoformat(),
            "ends_at": (now + dt.timedelta(days=41)).isoformat(),
        },
        "job-list": trainer_spec(
            world.alpha,
            preset="tiny",
            nodes=1,
            gpus_per_node=8,
            layout={"dp_shard": 8},
            seq_len=256,
        ),
        "job-estimate": trainer_spec(
            world.alpha, preset="tiny", nodes=1, gpus_per_node=8, seq_len=256
        ),
        "webhook-list": {"team": alpha, "url": "https://hooks.example.com/new"},
        "dataset-list": {
            "team": alpha,
            "name": "sec-new",
            "uri": "/shared/data/new",
            "index": {
                "tokenizer": {"name": "bytes", "vocab_size": 256},
                "shards": [{"file": "a.bin", "sha256": "0" * 64, "tokens": 1}],
            },
        },
        "nccl-profile-list": {"name": "sec-new", "title": "New", "fabric": "infiniband"},
        "nccl-lint": {"env": {"NCCL_DEBUG": "WARN"}, "fabric": "infiniband"},
        "tuning-run-list": {"pool": "sec-h100", "team": "sec-alpha", "sizes": [2**20]},
        "tuning-run-decline": {"reason": "test"},
        "owned-price-list": {
            "pool": ids["pool"],
            "effective_from": now.isoformat(),
            "purchase_price": "250000",
            "depreciation_months": 48,
            "electricity_per_kwh": "0.10",
            "pue": "1.20",
            "overhead_per_month": "1000",
            "default_power_w": 9000,
        },
        "cloud-price-list": {
            "instance_type": ids["p5"],
            "region": "us-west-2",
            "effective_from": now.isoformat(),
            "per_hour": "50.00",
            "source": "https://aws.amazon.com/ec2/pricing/on-demand/",
        },
        "pool-discount-list": {
            "pool": ids["cloud_pool"],
            "effective_from": now.isoformat(),
            "percent": "12",
        },
        "usage-correct": {"amount": "1.00", "note": "test"},
        "budget-list": {"team": alpha, "monthly_limit": "2000.00"},
        "checkpoint-s3-destination-list": {"team": alpha, "bucket": "sec-alpha"},
        "node-drain": {"reason": "maintenance"},
        "node-accept-host-key": {"fingerprint": "SHA256:nothing-offered"},
        "job-cancel": {"reason": "test"},
        "job-requeue": {"reason": "test"},
    }


def _client(world, role: str, credential: str) -> APIClient:
    if credential == "none":
        return APIClient()
    if credential == "session":
        client = APIClient(enforce_csrf_checks=True)
        client.cookies[settings.SESSION_COOKIE_NAME] = world.sessions[role]
        client.cookies[settings.CSRF_COOKIE_NAME] = world.csrf_cookie
        client.credentials(HTTP_X_CSRFTOKEN=world.csrf_token)
        return client
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens[role, credential]}")
    return client


def _model_of(route: str, method: str):
    """The model a write through this route would change (None for a view without one)."""
    callback = ROUTES[route].callback
    cls = getattr(callback, "cls", None)
    if cls is None or not hasattr(cls, "get_serializer_class"):
        return None
    view = cls(**callback.initkwargs)
    view.action = getattr(callback, "actions", {}).get(method.lower())
    return getattr(getattr(view.get_serializer_class(), "Meta", None), "model", None)


def _snapshot(model) -> tuple:
    """The audit log's length and every row of the table (a token's use is not a write)."""
    rows = []
    if model is not None:
        names = [f.attname for f in model._meta.concrete_fields if f.name != "last_used_at"]
        rows = list(model.objects.order_by("pk").values_list(*names))
    return AuditEvent.objects.count(), rows


def _send(client, method: str, path: str, body=None):
    data = json.dumps(body) if body is not None else None
    return client.generic(method, path, data=data or "", content_type="application/json")


def _expected(rule: Rule, case: Case) -> str:
    if case.role == ANON:
        return "unauthenticated"
    if case.credential in SCOPES and _rank(case.credential) < _rank(rule.scope):
        return "denied"
    return rule.outcome(case.role, case.target)


STATUS = {"unauthenticated": 401, "denied": 403, "hidden": 404}


APART = (PUBLIC, NODE, METRICS)  # each asked by tests of their own below
CHECKED = [key for key, rule in POLICY.items() if rule.scope not in APART]


@pytest.mark.parametrize(("route", "method"), CHECKED)
def test_access(route, method, world):
    """Every role, with every scope and a session, on the own team's object and another's:
    each answer as the table says, and nothing written when refused. One test per route, so
    that a failure lists every case of it that went wrong."""
    model = _model_of(route, method) if method != "GET" else None
    before = _snapshot(model) if method != "GET" else None
    wrong = [
        f"{case}: {problem}"
        for case in _cases(route, method)
        for problem in [_ask(world, case, model, before)]
        if problem
    ]
    assert not wrong, "\n".join(wrong)


def _ask(world, case: Case, model, before) -> str | None:
    """Make the request (in a savepoint, undone after); what went wrong, or None."""
    pk = world.objects[ROUTES[case.route].basename, case.target] if case.target else None
    body = _bodies(world).get(case.route, {}) if case.method != "GET" else None
    expected = _expected(POLICY[case.route, case.method], case)
    with transaction.atomic():
        client = _client(world, case.role, case.credential)
        answer = _send(client, case.method, url(case.route, pk), body)
        got, problem = answer.status_code, None
        if expected == "ok":
            if got in (401, 403, 404) or got >= 500:
                problem = f"expected it allowed, got {got} {answer.content[:200]!r}"
            elif case.method == "GET" and not ROUTES[case.route].detail:
                problem = _other_team_rows(world, case, answer)
        elif got != STATUS[expected]:
            problem = f"expected {STATUS[expected]}, got {got} {answer.content[:200]!r}"
        elif set(answer.json()["error"]) != {"code", "message", "details"}:
            problem = f"not the error shape: {answer.content[:200]!r}"
        elif before is not None and _snapshot(model) != before:
            problem = "refused, but the database changed"
        transaction.set_rollback(True)
    if expected == "ok" and case.method != "GET":
        cache.clear()  # what the undone write left in the cache goes with it
    return problem


def _other_team_rows(world, case, answer) -> str | None:
    """A list shows a team role nothing of another team."""
    basename = ROUTES[case.route].basename
    if case.role not in TEAM_ROLES or basename not in TEAMED:
        return None
    rows = answer.json()["results"]
    if world.objects[basename, "other"] in {row["id"] for row in rows}:
        return "the list shows another team's object"
    return None


NAMING_A_TEAM = [
    "team-quota-list",
    "membership-list",
    "service-account-list",
    "team-secret-list",
    "job-list",
    "webhook-list",
    "dataset-list",
    "budget-list",
    "checkpoint-s3-destination-list",
]


@pytest.mark.parametrize("route", NAMING_A_TEAM)
def test_a_team_role_cannot_write_into_another_team(route, world):
    """A body naming another team is refused as if the team did not exist: nothing written."""
    assert "team" in _bodies(world)[route]
    body = {**_bodies(world)[route], "team": world.beta.pk}
    model = _model_of(route, "POST")
    before = _snapshot(model)
    for role in sorted(TEAM_ROLES):
        with transaction.atomic():
            answer = _send(_client(world, role, ADMIN), "POST", url(route), body)
            assert answer.status_code == 400, (role, answer.content[:300])
            assert list(answer.json()["error"]["details"]) == ["team"], role
            assert _snapshot(model) == before
            transaction.set_rollback(True)


def test_every_scope_reads(world):
    for role in sorted(SIGNED_IN):
        for scope in SCOPES:
            answer = _send(_client(world, role, scope), "GET", url("me"))
            assert answer.status_code == 200 and answer.json()["token_scopes"] == [scope]


# --- what a scope or a session cannot do -------------------------------------------------


WRITES = [key for key, rule in POLICY.items() if key[1] != "GET" and rule.scope not in APART]


@pytest.mark.parametrize(("route", "method"), WRITES)
def test_a_session_write_without_the_csrf_token_is_refused(route, method, world):
    client = APIClient(enforce_csrf_checks=True)
    client.cookies[settings.SESSION_COOKIE_NAME] = world.sessions[SUPER]
    target = world.objects.get((ROUTES[route].basename, "own"))
    model = _model_of(route, method)
    before = _snapshot(model)
    answer = _send(client, method, url(route, target), _bodies(world).get(route, {}))
    assert answer.status_code == 403
    assert "CSRF" in answer.json()["error"]["message"]
    assert _snapshot(model) == before


API = [key for key, rule in POLICY.items() if rule.scope not in APART]


@pytest.mark.parametrize(("route", "method"), API)
def test_a_node_token_is_refused_by_the_api(route, method, world):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.node_token}")
    target = world.objects.get((ROUTES[route].basename, "own"))
    assert _send(client, method, url(route, target), {}).status_code == 401


# --- node agents' endpoints ---------------------------------------------------------------

AGENT = [key for key, rule in POLICY.items() if rule.scope == NODE]


@pytest.mark.parametrize(("route", "method"), AGENT)
def test_agent_endpoints_take_node_tokens_only(route, method, world):
    path = url(route)
    body = {} if method == "POST" else None
    token = APIClient()
    token.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens[SUPER, ADMIN]}")
    session = _client(world, SUPER, "session")
    for refused in (APIClient(), token, session):
        answer = _send(refused, method, path, body)
        assert answer.status_code == 401, answer.content[:300]
    node = APIClient()
    node.credentials(HTTP_AUTHORIZATION=f"Bearer {world.node_token}")
    answer = _send(node, method, path, body)
    assert answer.status_code not in (401, 403) and answer.status_code < 500, answer.content[:300]


# --- public endpoints ---------------------------------------------------------------------

PUBLIC_ROUTES = [key for key, rule in POLICY.items() if rule.scope == PUBLIC]


@pytest.mark.parametrize(("route", "method"), PUBLIC_ROUTES)
def test_public_endpoints_answer_anyone(route, method, world):
    assert _send(APIClient(), method, url(route)).status_code == 200


def test_metrics_answer_ops_sessions_only(world):
    path = url("metrics")
    assert _send(APIClient(), "GET", path).status_code == 401
    for role in SIGNED_IN:
        assert _send(_client(world, role, ADMIN), "GET", path).status_code == 401, role
        if role == SERVICE:
            continue  # tokens only
        answer = _send(_client(world, role, "session"), "GET", path)
        assert answer.status_code == (200 if role in OPS_ else 403), role


def test_metrics_token(world, settings):
    settings.METRICS_TOKEN = "metrics-secret"
    path = url("metrics")
    api_token = APIClient()
    api_token.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens[SUPER, ADMIN]}")
    assert _send(APIClient(), "GET", path).status_code == 401
    assert _send(api_token, "GET", path).status_code == 401
    right = APIClient()
    right.credentials(HTTP_AUTHORIZATION="Bearer metrics-secret")
    assert _send(right, "GET", path).status_code == 200


# --- writes the owner's role and scope allow happen --------------------------------------


def test_a_researchers_submit_token_submits_and_cancels_the_teams_job(world):
    client = _client(world, RESEARCHER, SUBMIT)
    answer = _send(client, "POST", url("job-list"), _bodies(world)["job-list"])
    assert answer.status_code == 201, answer.content[:500]
    job_id = answer.json()["id"]
    answer = _send(client, "POST", url("job-cancel", job_id), {"reason": "done"})
    assert answer.status_code == 200
    assert Job.objects.get(pk=job_id).state == "cancelled"


def test_a_team_admin_adds_a_member_and_a_secret(world):
    client = _client(world, TEAM_ADMIN, ADMIN)
    bodies = _bodies(world)
    assert (
        _send(client, "POST", url("membership-list"), bodies["membership-list"]).status_code == 201
    )
    assert Membership.objects.filter(
        team=world.alpha, user__username=world.ids["outsider"]
    ).exists()
    answer = _send(client, "POST", url("team-secret-list"), bodies["team-secret-list"])
    assert answer.status_code == 201 and "value" not in answer.json()


def test_every_role_sees_and_revokes_its_own_token(world):
    for role in sorted(SIGNED_IN):
        token = ApiToken.objects.get(user=world.users[role], scopes=[READ])
        client = _client(world, role, ADMIN)
        assert _send(client, "GET", url("token-detail", token.pk)).status_code == 200
        assert _send(client, "DELETE", url("token-detail", token.pk)).status_code == 204
        assert ApiToken.objects.get(pk=token.pk).revoked_at is not None


# --- roles a token or a service account must never gain -----------------------------------


def test_a_service_account_cannot_be_made_team_admin(world):
    membership = Membership.objects.get(user=world.users[SERVICE])
    client = _client(world, TEAM_ADMIN, ADMIN)
    answer = _send(client, "PATCH", url("membership-detail", membership.pk), {"role": "admin"})
    assert answer.status_code == 400
    membership.refresh_from_db()
    assert membership.role == "researcher"


def test_a_token_made_by_a_token_does_not_outlive_it(world):
    """A token minted with a token is contained by its parent: never an expiry after it."""
    expires = timezone.now() + dt.timedelta(hours=1)
    from apps.accounts import services

    _, secret = services.api_token_create(
        user=world.users[VIEWER], name="short", scopes=[ADMIN], expires_at=expires, by=None
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    answer = _send(client, "POST", url("token-list"), {"name": "child", "scopes": [ADMIN]})
    if answer.status_code == 201:
        child = ApiToken.objects.get(pk=answer.json()["id"])
        assert child.expires_at is not None and child.expires_at <= expires
    else:
        assert answer.status_code == 400
