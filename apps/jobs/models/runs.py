"""What runs on each node for a job (one Run per node per attempt), its output lines, the
figures and the NCCL environment its processes report."""

import shlex

from django.db import models
from django.db.models import Q


class RunState(models.TextChoices):
    PLANNED = "planned", "Planned"  # written; the node's agent has not started it yet
    RUNNING = "running", "Running"  # the agent started it
    EXITED = "exited", "Exited"  # the process ended (exit code or signal)
    REFUSED = "refused", "Refused"  # the agent could not start it (bad file path, git failed...)
    LOST = "lost", "Lost"  # its node went away, or it was superseded by a requeue


OPEN_RUN_STATES = frozenset({RunState.PLANNED, RunState.RUNNING})


class NodeFault(models.TextChoices):
    """Why an agent could not start a run, when the node is to blame and not the job: the
    agent says so in its report, so the job is requeued rather than failed."""

    RENDEZVOUS_PORT_BUSY = "rendezvous_port_busy", "Rendezvous port busy"


class Run(models.Model):
    """One attempt of a job on one node: the plan the node's agent runs, and how it ended.

    The plan never holds secret values: only their names. The agent endpoint
    decrypts them when the node fetches the plan.
    """

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="runs")
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="runs")
    attempt = models.PositiveSmallIntegerField(help_text="1 for the first run of the job.")
    node_rank = models.PositiveSmallIntegerField()
    # The GPUs the run holds on its node: it keeps them, even past its job's end, until
    # its process is gone (Allocation.release_wanted).
    allocation = models.ForeignKey(
        "jobs.Allocation",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="runs",
    )
    plan = models.JSONField(help_text="argv, env (no secret values), workdir, files, git.")
    secret_names = models.JSONField(default=list)
    # The NCCL profile version the plan's environment came from (tuning.NcclProfileVersion:
    # who made it, or which tuning run's figures chose it). Empty: none applied.
    nccl_profile = models.CharField(max_length=50, blank=True)
    nccl_profile_version = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=RunState.choices, default=RunState.PLANNED)
    pid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    signal = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=300, blank=True)
    node_fault = models.CharField(max_length=30, choices=NodeFault.choices, blank=True)
    # The rendezvous endpoint that node rank 0 hosts for this attempt (rank 0's row alone):
    # the host is the address the other ranks dial, so nodes that share an address (local
    # nodes, several nodes of one machine) share its ports too.
    rendezvous_host = models.CharField(max_length=255, blank=True)
    rendezvous_port = models.PositiveIntegerField(null=True, blank=True)
    status = models.JSONField(
        null=True, blank=True, help_text="What the process wrote to its status file."
    )
    evidence = models.JSONField(
        null=True,
        blank=True,
        help_text="How its processes died, as the node's kernel told the agent: the earliest "
        "killed by a signal the agent did not send (kind oom or signal, signal, pid, rank...).",
    )
    # The newest of the stage module's progress lines (workers/trainer/stage.py), checked
    # field by field: what the Job page says while the run copies its datasets.
    staging = models.JSONField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "attempt", "node_rank"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "node_rank"], name="one_run_per_rank_and_attempt"
            ),
            # Held from the plan until its process is gone (exited, refused or lost), so
            # two dispatches at once cannot give one port of a host to two jobs.
            models.UniqueConstraint(
                fields=["rendezvous_host", "rendezvous_port"],
                condition=Q(state__in=["planned", "running"], rendezvous_port__isnull=False),
                name="one_open_run_per_rendezvous_port",
            ),
        ]
        indexes = [
            models.Index(
                fields=["node"],
                condition=Q(state__in=["planned", "running"]),
                name="open_runs_by_node",
            ),
            # Ports an agent found busy lately, which dispatch leaves alone for a while.
            models.Index(
                fields=["rendezvous_host", "ended_at"],
                condition=Q(node_fault="rendezvous_port_busy"),
                name="busy_rendezvous_ports",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} rank {self.node_rank}"

    @property
    def command_line(self) -> str:
        """The argument list as a person would type it (shown, never run by a shell)."""
        return shlex.join(self.plan.get("argv") or [])

    @property
    def staging_note(self) -> str:
        """The newest stage line as a person reads it: "staging wiki-en: 3.2 of 12.0 GB,
        1.1 GB reused" (empty when the run staged nothing)."""
        event = self.staging or {}
        name = event.get("dataset", "")
        if event.get("event") == "stage_failed":
            return f"staging {name} failed: {event.get('message', '')}"
        if event.get("event") == "stage_end":
            return f"datasets staged: {_size(event.get('bytes', 0))}" + _reused(event)
        if event.get("in_place"):
            return f"{name}: read in place from shared storage"
        if event.get("event") == "stage":
            done, total = event.get("bytes_done", 0), event.get("bytes", 0)
            unit = _unit(total)
            of = f"{_size(done, unit)} of {_size(total, unit)} {unit[0]}"
            return f"staging {name}: {of}" + _reused(event)
        return ""


def _unit(nbytes: int) -> tuple[str, int]:
    for name, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if nbytes >= size:
            return name, size
    return "kB", 10**3


def _size(nbytes: int, unit: tuple[str, int] | None = None) -> str:
    name, size = unit or _unit(nbytes)
    number = f"{nbytes / size:.1f}"
    return number if unit else f"{number} {name}"


def _reused(event: dict) -> str:
    reused = event.get("reused_bytes", 0)
    return f", {_size(reused)} reused" if reused else ""


class LogLine(models.Model):
    """One line a run's processes wrote (secrets masked), relayed by the agent.

    (run, seq) is unique, so a batch the agent sends twice is kept once. Lines
    older than LOG_RETENTION_DAYS are deleted by a periodic task.
    """

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="log_lines")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="log_lines")
    seq = models.PositiveIntegerField()
    stream = models.CharField(max_length=10)
    at = models.DateTimeField()
    text = models.TextField()

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="one_line_per_run_seq"),
        ]
        indexes = [models.Index(fields=["job", "id"]), models.Index(fields=["at"])]

    def __str__(self) -> str:
        return f"run {self.run_id} #{self.seq}"


class StepMetric(models.Model):
    """One training step's figures, as the bundled trainer prints them (rank 0, one JSON line).

    Kept per attempt: after a resume the same steps come again, and the page draws the
    newest attempt over the older ones.
    """

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="step_metrics")
    attempt = models.PositiveSmallIntegerField()
    step = models.PositiveIntegerField()
    at = models.DateTimeField()
    loss = models.FloatField(null=True, blank=True)
    grad_norm = models.FloatField(null=True, blank=True)
    lr = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    mfu = models.FloatField(null=True, blank=True)
    peak_mem_gib = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["job", "attempt", "step"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "step"], name="one_metric_per_job_attempt_step"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} step {self.step}"


class EvalMetric(models.Model):
    """One evaluation on held-out data, as the bundled trainer prints it (rank 0: `{"event":
    "eval","step","loss","perplexity","tokens",...}`, workers/trainer/evaluation.py).

    Kept per attempt, as step metrics are: a resumed attempt evaluates the same steps again.
    """

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="eval_metrics")
    attempt = models.PositiveSmallIntegerField()
    step = models.PositiveIntegerField()
    at = models.DateTimeField()
    loss = models.FloatField(help_text="Mean loss over the held-out sequences (mixture-weighted).")
    perplexity = models.FloatField(null=True, blank=True, help_text="exp(loss).")
    tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="Tokens evaluated.")

    class Meta:
        ordering = ["job", "attempt", "step"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "step"], name="one_eval_per_job_attempt_step"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} eval at step {self.step}"


class RankEnvironment(models.Model):
    """The NCCL, PyTorch-NCCL and EFA variables one rank of an attempt says it started with
    (the trainer's "env" event), kept to compare with what the run's plan rendered.

    One per rank and attempt: the first report counts. Job output is data: the rank is
    checked against the job's world and only those variables are kept.
    """

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="rank_environments")
    run = models.ForeignKey(
        Run,
        on_delete=models.CASCADE,
        related_name="rank_environments",
        help_text="The run (node) whose output carried the report.",
    )
    attempt = models.PositiveSmallIntegerField()
    rank = models.PositiveIntegerField()
    local_rank = models.PositiveIntegerField()
    node_rank = models.PositiveIntegerField()
    env = models.JSONField(help_text="Variable name → value, as the process started with them.")
    reported_at = models.DateTimeField()

    class Meta:
        ordering = ["job", "attempt", "rank"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "rank"], name="one_environment_per_job_attempt_rank"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} rank {self.rank}"
