"""A training job: what it asks for, where it is in its life, and what it holds."""

import uuid

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

from apps.accounts.models import GPU_TYPES
from apps.jobs.scheduler.snapshot import BEYOND_DEPTH
from controlplane.cache import best_effort
from controlplane.events import StateChange

ANY_GPU = "ANY"
JOB_GPU_TYPES = [*GPU_TYPES, (ANY_GPU, "Any")]


ASK_CACHE = object()  # Job.last_pass_at not known on the instance: read it from the cache


class JobState(models.TextChoices):
    PENDING = "pending", "Pending"
    HELD = "held", "Held"
    ADMITTED = "admitted", "Admitted"
    PROVISIONING = "provisioning", "Provisioning"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    PREEMPTING = "preempting", "Preempting"
    STOPPING = "stopping", "Stopping"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


J = JobState
# Groups of states the services, the scheduler and the pages all ask about.
HOLDING_STATES = frozenset(
    {J.ADMITTED, J.PROVISIONING, J.STARTING, J.RUNNING, J.PREEMPTING, J.STOPPING}
)  # allocations open: the job holds GPUs
NOT_STARTED_STATES = frozenset({J.ADMITTED, J.PROVISIONING})  # no process yet: no checkpoint
STARTED_STATES = frozenset({J.STARTING, J.RUNNING})
STOPPING_STATES = frozenset({J.PREEMPTING, J.STOPPING})  # on their way out; not preempted again
FINISHED_STATES = frozenset({J.SUCCEEDED, J.FAILED, J.CANCELLED})
ACTIVE_STATES = frozenset({J.PENDING, J.HELD} | HOLDING_STATES)


class PriorityClass(models.TextChoices):
    LOW = "low", "Low"
    NORMAL = "normal", "Normal"
    HIGH = "high", "High"
    URGENT = "urgent", "Urgent"


PRIORITY_RANK = {
    PriorityClass.LOW: 0,
    PriorityClass.NORMAL: 1,
    PriorityClass.HIGH: 2,
    PriorityClass.URGENT: 3,
}


class JobKind(models.TextChoices):
    TRAINER = "trainer", "Bundled trainer"
    COMMAND = "command", "Custom command"
    # A tuning run's measurement (apps/jobs/tuning_runs.py): the bundled collective benchmark,
    # once per candidate NCCL setting and round, on the nodes the run names.
    TUNING = "tuning", "NCCL tuning run"


class Placement(models.TextChoices):
    OWNED = "owned", "Owned only"
    OWNED_THEN_CLOUD = "owned_then_cloud", "Owned, then cloud"
    CLOUD = "cloud", "Cloud only"


class JobQuerySet(models.QuerySet):
    def live(self) -> "JobQuerySet":
        """Jobs not finished, through the `live_jobs` index: say it in any query for jobs
        in live states (pending, admitted, running...) so it reads those rows alone, not
        every job the table has kept."""
        return self.filter(finished_at__isnull=True)


class Job(models.Model):
    uuid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=100)
    # Indexed by (team, id) below, which serves team look-ups too.
    team = models.ForeignKey(
        "accounts.Team", on_delete=models.PROTECT, related_name="jobs", db_index=False
    )
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
    )
    priority_class = models.CharField(
        max_length=10, choices=PriorityClass.choices, default=PriorityClass.NORMAL
    )
    kind = models.CharField(max_length=10, choices=JobKind.choices)
    spec = models.JSONField(help_text="The validated spec as submitted (secrets by name only).")

    gpu_type = models.CharField(max_length=10, choices=JOB_GPU_TYPES)
    nodes = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    # The fewest nodes an attempt may run on (Slurm's --nodes=min-max): the scheduler places
    # the whole `nodes` when it can and fewer, not below this, only when it cannot. Null:
    # exactly `nodes` (no range).
    min_nodes = models.PositiveSmallIntegerField(null=True, blank=True)
    gpus_per_node = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    dp_replicate = models.PositiveSmallIntegerField(default=1)
    dp_shard = models.PositiveSmallIntegerField(default=1)
    tp = models.PositiveSmallIntegerField(default=1)
    pp = models.PositiveSmallIntegerField(default=1)
    placement = models.CharField(
        max_length=20, choices=Placement.choices, default=Placement.OWNED_THEN_CLOUD
    )
    spot_allowed = models.BooleanField(default=False)
    # Pinned: the job runs on exactly these nodes, all of them, or waits (a tuning run's, which
    # measures the nodes ops chose). Null: wherever the scheduler places it.
    node_ids = models.JSONField(null=True, blank=True, editable=False)

    time_limit_s = models.PositiveIntegerField(
        validators=[MinValueValidator(60), MaxValueValidator(30 * 86400)]
    )
    max_cost_usd = models.DecimalField(max_digits=12, decimal_places=2, null=True, blank=True)
    restart_limit = models.PositiveSmallIntegerField(default=3)
    restarts = models.PositiveSmallIntegerField(default=0, editable=False)

    state = models.CharField(
        max_length=20, choices=JobState.choices, default=JobState.PENDING, editable=False
    )
    state_reason = models.CharField(max_length=300, blank=True, editable=False)
    state_changed_at = models.DateTimeField(auto_now_add=True, editable=False)
    # No foreign-key constraint in the database (as Allocation's): a first scheduling pass
    # sets the pool of about 4,000 jobs, and checking each reference at commit cost more
    # than a tenth of its write. The pool is set by placements on nodes the pass has
    # locked, and a pool with nodes cannot be deleted (Node.pool is PROTECTed and keeps
    # its constraint); Django's SET_NULL still applies when a pool goes. Not indexed
    # either: a placement sets it, and an indexed column would keep the row from being
    # updated in place (Meta). Deleting a pool scans the jobs once, which is rare enough.
    pool = models.ForeignKey(
        "fleet.NodePool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
        editable=False,
        db_constraint=False,
        db_index=False,
    )
    idempotency_key = models.CharField(max_length=200, blank=True, editable=False)
    estimate = models.JSONField(
        null=True,
        blank=True,
        editable=False,
        help_text="What the advisor predicted at submit (apps/jobs/advisor.py): memory per GPU, "
        "step time, run time and cost, kept to set beside what happened.",
    )

    queued_at = models.DateTimeField(
        editable=False, help_text="Its place in the queue by age; kept when it is requeued."
    )
    submitted_at = models.DateTimeField(auto_now_add=True)
    admitted_at = models.DateTimeField(null=True, blank=True, editable=False)
    started_at = models.DateTimeField(null=True, blank=True, editable=False)
    finished_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-submitted_at", "-id"]
        # No index names a column that the scheduler's placement or a later state change
        # writes (state, pool, the times of its moves), and pages are filled to 80%
        # (migration 0010): PostgreSQL then writes a job's new version beside the old one
        # on its page (a HOT update) rather than an entry into each index, which took
        # about half of a first pass's job updates (bench/RESULTS.md). What is live (not
        # finished) is found by `live_jobs`, whose condition only finishing changes; a
        # query for live states says so with Job.objects.live() to use it.
        indexes = [
            models.Index(
                fields=["team", "queued_at"],
                condition=Q(finished_at__isnull=True),
                name="live_jobs",
            ),
            models.Index(fields=["team", "id"], name="jobs_by_team"),
            models.Index(
                fields=["finished_at"],
                condition=Q(finished_at__isnull=False),
                name="finished_jobs",
            ),
            # The default order (newest submitted first), for lists of every team's jobs
            # (ops' /api/v1/jobs/, Checkpoints): read a page from the index rather than
            # sort 100,000 jobs (bench/pages.py). submitted_at is written once.
            models.Index(fields=["-submitted_at", "-id"], name="jobs_by_submission"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="one_job_per_idempotency_key",
            ),
            # A job that is not finished has no finished_at, or live_jobs would miss it
            # (and the scheduler with it).
            models.CheckConstraint(
                condition=Q(finished_at__isnull=True) | Q(state__in=sorted(FINISHED_STATES)),
                name="only_finished_jobs_have_finished_at",
            ),
            models.CheckConstraint(
                condition=Q(min_nodes__isnull=True)
                | Q(min_nodes__gte=1, min_nodes__lte=models.F("nodes")),
                name="min_nodes_within_nodes",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes an attempt may run on: min_nodes, or nodes without a range."""
        return self.min_nodes or self.nodes

    def wait_row(self):
        """The job's JobWait, or None (a job the last pass did not try has none)."""
        try:
            return self.wait
        except JobWait.DoesNotExist:
            return None

    # When the last committed pass read the queue, as pending_reason needs it for a job
    # without a wait row: asked of the cache unless set on the instance, as a page of jobs
    # does once for all of them (jobs_note_last_pass) and a submit does for its new job
    # (None: no pass has read it yet).
    last_pass_at: float | object | None = ASK_CACHE

    def refresh_from_db(self, *args, **kwargs):
        super().refresh_from_db(*args, **kwargs)
        self.__dict__.pop("last_pass_at", None)  # passes since may have read it: ask again

    @property
    def pending_reason(self) -> str:
        """Why a pending job waits, as the last scheduling pass put it.

        No wait row: the last pass did not try the job. If it was already pending when
        that pass read the queue, it was past the backfill depth (the pass stores no row
        for those); otherwise it has not been through a pass yet. (A job that becomes
        pending in the instant before a pass reads, committed just after, reads as the
        former until the next pass: both say it has not been tried.)"""
        if self.state != JobState.PENDING:
            return ""
        wait = self.wait_row()
        if wait is not None:
            return wait.reason
        last_pass_at = self.last_pass_at
        if last_pass_at is ASK_CACHE:
            last_pass_at = last_pass_read_at()
        return waiting_reason(None, self.state_changed_at, last_pass_at)

    @property
    def estimated_start(self):
        wait = self.wait_row() if self.state == JobState.PENDING else None
        return wait.estimated_start if wait is not None else None


NOT_YET_PLANNED = "waiting for the next scheduling pass"
# What each committed scheduling pass publishes in the cache for the pages and the API.
LAST_PASS_KEY = "jobs:last-pass-at"  # noqa: S105 (a cache key): when the last pass read
QUEUE_ORDER_KEY = "jobs:queue-order"  # the pending jobs' ids in queue order


def last_pass_read_at() -> float | None:
    """When the last committed scheduling pass read the queue (epoch seconds), if known."""
    return best_effort.get(LAST_PASS_KEY)


def waiting_reason(stored: str | None, state_changed_at, last_pass_at: float | None) -> str:
    """A pending job's reason: its wait row's, or, without one, whether the last pass
    read it (then it lay past the backfill depth) or not (Job.pending_reason)."""
    if stored is not None:
        return stored
    if last_pass_at is not None and state_changed_at.timestamp() < last_pass_at:
        return BEYOND_DEPTH
    return NOT_YET_PLANNED


def jobs_note_last_pass(jobs) -> None:
    """Read the last pass's time once for a list of jobs about to show their reasons."""
    last_pass_at = last_pass_read_at()
    for job in jobs:
        job.last_pass_at = last_pass_at


class JobWait(models.Model):
    """Why a pending job waits and when it may start: rewritten by every scheduling pass.

    Derived, not a record: on PostgreSQL the table is UNLOGGED (no write-ahead log, so a
    pass writes thousands of reasons cheaply), and after a crash it comes back empty
    until the next pass, which a reader sees as a job not tried (Job.pending_reason).
    Jobs past the backfill depth have no row. Kept apart from the job row so a pass
    never rewrites wide job rows.
    """

    # No foreign-key constraint in the database: checking one for each of a first pass's
    # 40,000 new rows doubled its commit. Rows are written only by the pass, for jobs it
    # has just read as pending, and Django's CASCADE removes them with their job.
    job = models.OneToOneField(
        Job, on_delete=models.CASCADE, primary_key=True, related_name="wait", db_constraint=False
    )
    reason = models.CharField(max_length=300)
    estimated_start = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.reason}"


class JobEvent(StateChange):
    """One state change of a job: append-only."""

    # No foreign-key constraint in the database: events are written with the job they
    # record (a submission inserts both in one statement; a pass writes 4,000 at once for
    # jobs it has locked), and jobs are deleted only through Django, whose CASCADE
    # removes their events.
    job = models.ForeignKey(
        Job, on_delete=models.CASCADE, related_name="events", db_constraint=False
    )
    to_state = models.CharField(max_length=20, choices=JobState.choices)

    class Meta:
        ordering = ["at", "id"]
        indexes = [
            models.Index(
                fields=["actor"], condition=Q(actor__isnull=False), name="job_events_by_people"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}: {self.from_state or '·'} → {self.to_state}"


class Allocation(models.Model):
    """GPUs of one node held by one job from `started_at` to `ended_at` (open while held).

    Fair share reads these now; the cost ledger meters them later.
    """

    # No foreign-key constraints in the database: a first pass writes 11,000 allocations,
    # and checking their 22,000 references at commit was a fifth of the pass's write.
    # Only the scheduler's apply writes allocations, for job and node rows it has locked
    # (SELECT ... FOR UPDATE) and checked in the same transaction, so both exist when it
    # commits; Django's PROTECT still refuses to delete a job or node that has any.
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(
        Job, on_delete=models.PROTECT, related_name="allocations", db_constraint=False
    )
    # Indexed by node twice, partially (Meta), rather than in full: a new allocation is
    # open and enters open_allocations alone, one index entry fewer for each of a first
    # pass's 11,000. Deleting a node (rare) scans the table for the PROTECT check.
    node = models.ForeignKey(
        "fleet.Node",
        on_delete=models.PROTECT,
        related_name="allocations",
        db_constraint=False,
        db_index=False,
    )
    gpus = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    # Which of the node's GPUs: bit i is GPU i (slots_of). Chosen by the scheduler's
    # apply step under the node's lock, never shared by two open allocations; the
    # runs on the node see them as CUDA_VISIBLE_DEVICES.
    gpu_slots = models.PositiveBigIntegerField(default=0)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    # The job no longer wants these GPUs, but a run of it on the node has not ended yet:
    # the allocation ends when its last run does (allocations_release), so no other job
    # is placed on GPUs whose processes are still there.
    release_wanted = models.BooleanField(default=False)

    class Meta:
        ordering = ["started_at", "id"]
        indexes = [
            models.Index(
                fields=["node"], condition=Q(ended_at__isnull=True), name="open_allocations"
            ),
            # The metering's look-back (allocations_overlapping): what ended on these nodes
            # since a time, without walking each node's whole history.
            models.Index(
                fields=["node", "ended_at"],
                condition=Q(ended_at__isnull=False),
                name="closed_allocations",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} on node {self.node_id}: {self.gpus} GPUs"

    @property
    def slots(self) -> list[int]:
        return slots_of(self.gpu_slots)


def slots_of(mask: int) -> list[int]:
    """The GPU indices a slot mask holds, lowest first."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def mask_of(slots) -> int:
    mask = 0
    for i in slots:
        mask |= 1 << i
    return mask


def lowest_free(used: int, *, count: int, size: int) -> int:
    """A mask of the `count` lowest GPUs of a `size`-GPU node not in `used`; 0 if too few."""
    mask, free = 0, 0
    for i in range(size):
        if not used >> i & 1:
            mask |= 1 << i
            free += 1
            if free == count:
                return mask
    return 0
