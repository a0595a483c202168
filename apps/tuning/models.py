"""NCCL profiles: the environment that nodes of one fabric (and NCCL version range) get."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

from apps.accounts.models import slug_validator
from apps.fleet.models import Fabric
from apps.fleet.models.pools import NCCL_VERSION_PATTERN
from apps.tuning import catalogue, linter
from controlplane.events import StateChange

ANY_FABRIC = "any"
PROFILE_FABRICS = [(ANY_FABRIC, "Any fabric"), *Fabric.choices]

version_validator = RegexValidator(
    NCCL_VERSION_PATTERN, "An NCCL version such as 2.21.5.", code="invalid"
)


class NcclProfile(models.Model):
    """Ops edit these; every signed-in user reads them. Jobs name one, or get their pool's
    default: the default profile of the pool's fabric whose version range holds the pool's
    NCCL (single-node jobs get the single-node default)."""

    name = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    title = models.CharField(max_length=200)
    description = models.TextField(blank=True, max_length=4000)
    fabric = models.CharField(max_length=20, choices=PROFILE_FABRICS, default=ANY_FABRIC)
    single_node = models.BooleanField(
        default=False, help_text="For jobs that fit on one node: no network between nodes."
    )
    min_nccl_version = models.CharField(
        max_length=20, blank=True, validators=[version_validator], help_text="Empty: any."
    )
    max_nccl_version = models.CharField(
        max_length=20, blank=True, validators=[version_validator], help_text="Empty: any."
    )
    is_default = models.BooleanField(
        default=False,
        help_text="Given to jobs that name no profile, on pools of this fabric and versions.",
    )
    env = models.JSONField(default=dict, blank=True, help_text="Variable name → value.")
    reasons = models.JSONField(
        default=dict, blank=True, help_text="Why a variable the linter warns about is kept."
    )
    built_in = models.BooleanField(default=False, editable=False)
    # Tuned for one pool: that pool's multi-node jobs get it before any default (a tuning
    # run's adoption makes one, apps/tuning/runs.py).
    pool = models.OneToOneField(
        "fleet.NodePool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="nccl_profile",
        editable=False,
    )
    version = models.PositiveIntegerField(default=0, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        editable=False,
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "NCCL profile"

    def __str__(self) -> str:
        return self.name

    def clean(self):
        errors = {}
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            errors["env"] = "A mapping of variable names to text values."
        elif any(not linter.NAME_RE.match(k) for k in self.env):
            errors["env"] = "Variable names are letters, digits and underscores."
        if not isinstance(self.reasons, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.reasons.items()
        ):
            errors["reasons"] = "A mapping of variable names to reasons."
        low, high = self.min_nccl_version, self.max_nccl_version
        if low and high and parse_version(low) > parse_version(high):
            errors["max_nccl_version"] = "Must not be below min_nccl_version."
        if errors:
            raise ValidationError(errors)

    @property
    def lint_context(self) -> linter.Context:
        """Lint against the oldest NCCL the profile claims to fit."""
        fabric = "" if self.fabric == ANY_FABRIC else self.fabric
        return linter.Context(
            fabric=fabric, nccl_version=self.min_nccl_version, single_node=self.single_node
        )

    def lint(self) -> list[linter.Verdict]:
        return linter.lint(self.env or {}, context=self.lint_context, reasons=self.reasons or {})

    def fits(self, nccl_version: str) -> bool:
        """Whether a pool with this NCCL version is inside the profile's range ('' fits)."""
        if not nccl_version:
            return True
        version = parse_version(nccl_version)
        if self.min_nccl_version and not catalogue.version_at_least(version, self.min_nccl_version):
            return False
        return not (self.max_nccl_version and version > parse_version(self.max_nccl_version))


def parse_version(text: str) -> tuple[int, ...]:
    try:
        return catalogue.version_tuple(text)
    except ValueError:
        return ()


# --- versions: every change of a profile's environment, with where it came from ---------------


class VersionSource(models.TextChoices):
    CREATED = "created", "Created"
    EDITED = "edited", "Edited"
    ADOPTED = "adopted", "Adopted from a tuning run"
    RESTORED = "restored", "Restored"


class NcclProfileVersion(models.Model):
    """A profile's environment as it stood from `made_at`: append-only. A job's runs record
    the version they got, and an adopted version names the tuning run whose figures chose it,
    so any job's NCCL environment traces back to the measurement (or the person) behind it."""

    profile = models.ForeignKey(NcclProfile, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    env = models.JSONField(default=dict)
    reasons = models.JSONField(default=dict)
    source = models.CharField(max_length=10, choices=VersionSource.choices)
    note = models.CharField(max_length=300, blank=True)
    tuning_run = models.ForeignKey(
        "tuning.TuningRun", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    made_at = models.DateTimeField(auto_now_add=True)
    made_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["profile", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["profile", "number"], name="one_version_number"),
        ]

    def __str__(self) -> str:
        return f"{self.profile.name} v{self.number}"


# --- tuning runs ---------------------------------------------------------------------------


class TuningRunKind(models.TextChoices):
    TUNING = "tuning", "Tuning"  # the baseline against candidates: may adopt one
    DRIFT = "drift", "Drift check"  # the baseline alone, against its adopted figures


# A drift check's steps: the pool's nodes together; pairs of them; a node of a slow pair
# against a node of a steady one; a node back from repair against a steady one.
BISECT_TOP, BISECT_PAIRS, BISECT_AGAINST_GOOD, BISECT_REPAIRED = 0, 1, 2, 3


class TuningRunState(models.TextChoices):
    QUEUED = "queued", "Queued"  # its job waits for the nodes
    RUNNING = "running", "Running"
    JUDGING = "judging", "Judging"  # measured: the adoption rule is being applied
    AWAITING_APPROVAL = "awaiting", "Awaiting approval"  # a candidate passed; ops decide
    ADOPTED = "adopted", "Adopted"
    NOTHING_ADOPTED = "nothing", "Nothing adopted"  # no candidate beat the noise
    DECLINED = "declined", "Declined"  # ops kept the baseline
    STEADY = "steady", "Steady"  # a drift check within the noise of the adopted figures
    DRIFTED = "drifted", "Drifted"  # a drift check slower beyond the noise
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


TUNING_FINISHED = {
    TuningRunState.ADOPTED,
    TuningRunState.NOTHING_ADOPTED,
    TuningRunState.DECLINED,
    TuningRunState.STEADY,
    TuningRunState.DRIFTED,
    TuningRunState.FAILED,
    TuningRunState.CANCELLED,
}


class TuningRun(models.Model):
    """One measurement of a pool's NCCL settings on some of its nodes: the baseline (the
    profile its multi-node jobs get now) and candidates, interleaved over rounds, by the
    bundled collective benchmark run as a job (`job`) that holds the nodes while it runs."""

    kind = models.CharField(max_length=10, choices=TuningRunKind.choices)
    pool = models.ForeignKey("fleet.NodePool", on_delete=models.PROTECT, related_name="+")
    node_ids = models.JSONField(default=list)
    node_names = models.JSONField(default=list)
    job = models.OneToOneField(
        "jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="tuning_run"
    )
    profile = models.ForeignKey(
        NcclProfile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    baseline_version = models.ForeignKey(
        NcclProfileVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # [{"index", "label", "changes": {...}, "env": {...}, "origin"}]; index 0 is the baseline.
    candidates = models.JSONField(default=list)
    ops = models.JSONField(default=list)
    sizes = models.JSONField(default=list)  # bytes, smallest first
    sizes_that_matter = models.JSONField(default=list)  # bytes
    rounds = models.PositiveSmallIntegerField()
    order = models.JSONField(default=list)  # per round, the candidate indices in launch order
    warmup = models.PositiveSmallIntegerField(default=5)
    iters = models.PositiveSmallIntegerField(default=20)
    approval_required = models.BooleanField(default=True)
    # A drift check's reference: the run whose figures the pool's settings were adopted on.
    reference = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    measured_at = models.DateTimeField(null=True, blank=True)
    # Bisection of a drift (apps/jobs/tuning_runs.py drift_followup): the check that found it,
    # and which step this one is (BISECT_* below).
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )
    step = models.PositiveSmallIntegerField(default=0)
    state = models.CharField(
        max_length=10, choices=TuningRunState.choices, default=TuningRunState.QUEUED
    )
    state_reason = models.CharField(max_length=300, blank=True)
    launches_done = models.PositiveIntegerField(default=0)
    # The verdicts (apps/tuning/adoption.py) once measured: {"chosen", "reason", "verdicts"}.
    result = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    adopted_version = models.ForeignKey(
        NcclProfileVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} #{self.pk} on {self.pool_id}"

    @property
    def launches_total(self) -> int:
        return self.rounds * len(self.candidates)

    @property
    def finished(self) -> bool:
        return self.state in TUNING_FINISHED


class TuningRunEvent(StateChange):
    run = models.ForeignKey(TuningRun, on_delete=models.CASCADE, related_name="events")
    from_state = models.CharField(max_length=10, choices=TuningRunState.choices, blank=True)
    to_state = models.CharField(max_length=10, choices=TuningRunState.choices)

    class Meta:
        ordering = ["at", "id"]


class TuningMeasurement(models.Model):
    """One figure of the collective benchmark: candidate (0: the baseline), round, operation
    and message size, as rank 0 of the run's job printed it, checked against the run's plan."""

    run = models.ForeignKey(TuningRun, on_delete=models.CASCADE, related_name="measurements")
    candidate = models.PositiveSmallIntegerField()
    round = models.PositiveSmallIntegerField()
    op = models.CharField(max_length=20)
    bytes = models.BigIntegerField()
    busbw_gbps = models.FloatField()
    algbw_gbps = models.FloatField()
    time_us = models.FloatField()
    errors = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["run", "candidate", "round", "op", "bytes"], name="one_figure_per_point"
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} c{self.candidate} r{self.round} {self.op} {self.bytes}"
