"""JSON shapes of job specs, jobs, their events, the queue, reservations and tuning runs.

The submit serializers check types and ranges only; the rules that tie the
fields together (layout against GPUs, tp against heads...) live in apps/jobs/specs.py.
"""

import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.accounts.models import GPU_TYPES
from apps.accounts.selectors import teams_visible_to
from apps.fleet.models import Node
from apps.jobs import specs
from apps.jobs.extensions import job_detail_part
from apps.jobs.models import (
    Dataset,
    EvalMetric,
    Job,
    JobEvent,
    Placement,
    PriorityClass,
    Reservation,
    Webhook,
)
from apps.jobs.models.jobs import ACTIVE_STATES, ANY_GPU
from apps.jobs.selectors import (
    LOG_SEARCH_MAX,
    job_attempt_nodes,
    job_cost,
    job_nccl_environments,
    job_rank_environments,
    jobs_visible_to,
    webhook_url_seen_by,
)
from apps.tuning import runs as tuning_runs
from apps.tuning.api.serializers import EnvironmentField
from apps.tuning.models import TuningRunKind, TuningRunState
from apps.tuning.selectors import tuning_run_progress
from controlplane.api import (
    ScopedPrimaryKeyField,
    SharedFieldsMixin,
    StrictModelSerializer,
    StrictSerializer,
    Text,
    TextKeyedDictField,
)
from workers.trainer.presets import PRESETS

# The trainer's own choices (workers/trainer/config.py; apps import only its presets, so a
# test keeps these lists equal to the trainer's).
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b")
PRECISIONS = ("bf16", "fp32", "fp8")

# \A and \Z, not ^ and $: "$" also matches before a final newline ("FOO\n").
ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


class SpecSerializer(SharedFieldsMixin, StrictSerializer):
    """A part of the job spec: its fields read nothing from the request, so they are
    built once per process (submission is the API's hottest write)."""


def _count(maximum: int, **kwargs):
    return serializers.IntegerField(min_value=1, max_value=maximum, **kwargs)


class LayoutSerializer(SpecSerializer):
    """How the job's GPUs are split: dp_replicate × dp_shard × tp × pp must equal its GPUs
    (default: FSDP over all of them)."""

    dp_replicate = _count(4096, required=False)
    dp_shard = _count(4096, required=False)
    tp = _count(specs.MAX_GPUS_PER_NODE, required=False)
    pp = _count(512, required=False)


class ResourcesSerializer(SpecSerializer):
    """The GPUs the job asks for: a type, a count (or nodes × GPUs per node) and a layout."""

    gpu_type = serializers.ChoiceField(choices=[*GPU_TYPES, (ANY_GPU, "Any")], default=ANY_GPU)
    gpus = _count(specs.MAX_GPUS, required=False)
    nodes = _count(specs.MAX_NODES, required=False)
    min_nodes = _count(
        specs.MAX_NODES,
        required=False,
        help_text="The fewest nodes an attempt may run on (default: nodes). The whole count "
        "is placed when it fits; fewer only when it does not, dp_shard taking up the change.",
    )
    gpus_per_node = _count(specs.MAX_GPUS_PER_NODE, required=False)
    layout = LayoutSerializer(required=False)


class PlacementSerializer(SpecSerializer):
    """Where the job may run: owned racks, the cloud, or owned first; and whether spot
    instances will do."""

    where = serializers.ChoiceField(choices=Placement.choices, default=Placement.OWNED_THEN_CLOUD)
    spot = serializers.BooleanField(default=False)


class ModelSizesSerializer(SpecSerializer):
    """The model's sizes, for a model that is not one of the presets."""

    layers = _count(1024)
    dim = _count(65536)
    heads = _count(1024)
    kv_heads = _count(1024)
    ffn_dim = _count(262144)
    vocab_size = _count(1048576)
    max_seq_len = _count(1048576, required=False)


class PipelineSerializer(SpecSerializer):
    """Pipeline parallelism (with pp above 1): its schedule and micro-batches."""

    schedule = serializers.ChoiceField(choices=PIPELINE_SCHEDULES, default="1f1b")
    microbatches = _count(100_000, required=False)
    stages_per_rank = _count(64, required=False)


class MixtureEntrySerializer(SpecSerializer):
    """One dataset of the team's (by name) and how much of the training data it gives."""

    dataset = serializers.SlugField(max_length=100)
    weight = serializers.FloatField(min_value=0, max_value=1e6)

    def validate_weight(self, value):
        if value <= 0:
            raise serializers.ValidationError("A weight above 0.")
        return value


class TrainerDataSerializer(SpecSerializer):
    """Registered datasets to train on (/api/v1/datasets/), mixed by weight."""

    mixture = serializers.ListField(child=MixtureEntrySerializer(), min_length=1, max_length=64)


class EvalSerializer(SpecSerializer):
    """Loss and perplexity on held-out data: the validation split of the mixture's datasets
    (prepared with a validation split), every `every` steps and at the end."""

    every = serializers.IntegerField(
        min_value=0, max_value=10_000_000, help_text="Steps between evaluations; 0: never."
    )
    batches = _count(
        100_000,
        default=1,
        help_text="Global batches of each dataset's held-out sequences (the same each time).",
    )


class InitSerializer(SpecSerializer):
    """Where the model's starting weights come from (default: the seeded random start)."""

    hf = Text(
        max_length=1024,
        help_text="A Hugging Face Llama directory (config.json and safetensors) on a path every "
        "node mounts; its sizes must be the model's (preset or sizes), checked at start.",
    )


class TrainerSerializer(SpecSerializer):
    """A run of the bundled trainer: a model (a preset or explicit sizes), its data, how long
    it trains, and how often it checkpoints (by default only at the end)."""

    preset = serializers.ChoiceField(choices=sorted(PRESETS), required=False)
    model = ModelSizesSerializer(required=False)
    dataset = Text(
        max_length=1024,
        required=False,
        help_text="A token file path on shared storage, or 'synthetic' (without data.mixture).",
    )
    data = TrainerDataSerializer(required=False)
    steps = _count(10_000_000)
    global_batch = _count(1_000_000, help_text="Sequences per optimiser step.")
    seq_len = _count(1_048_576)
    precision = serializers.ChoiceField(
        choices=PRECISIONS,
        default="bf16",
        help_text="bf16: mixed precision; fp32: full precision; fp8: bf16 with the transformer "
        "blocks' linear layers multiplied in float8 (dynamic tensorwise scaling), which needs "
        f"FP8 tensor cores (gpu_type {' or '.join(specs.FP8_GPU_TYPES)}) and layout.tp 1.",
    )
    activation_checkpointing = serializers.ChoiceField(
        choices=["none", "selective", "full"], default="selective"
    )
    checkpoint_every_steps = _count(10_000_000, required=False)
    checkpoint_every_minutes = _count(10_080, required=False)
    checkpoint_keep = _count(
        1000, required=False, help_text="Retention keeps the newest this many (default 3)."
    )
    checkpoint_keep_every = _count(
        10_000_000,
        required=False,
        help_text="...and every checkpoint whose step is a multiple of this (and the final one).",
    )
    compile = serializers.BooleanField(default=False)
    check_memory = serializers.BooleanField(
        default=True,
        help_text="Refuse the job when the memory model says its layout fits none of the GPUs "
        "it may land on (the 400 gives the numbers); false submits it anyway.",
    )
    # Tuning the trainer's defaults (workers/trainer/config.py says what each does).
    micro_batch = _count(1_000_000, required=False)
    lr = serializers.FloatField(min_value=0, max_value=10, required=False)
    warmup_steps = serializers.IntegerField(min_value=0, max_value=10_000_000, required=False)
    min_lr_ratio = serializers.FloatField(min_value=0, max_value=1, required=False)
    grad_clip = serializers.FloatField(min_value=0, max_value=1e6, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    collective_timeout_s = serializers.IntegerField(min_value=10, max_value=86400, required=False)
    log_every = _count(100_000, required=False)
    attention_backend = serializers.ChoiceField(choices=ATTENTION_BACKENDS, required=False)
    pipeline = PipelineSerializer(required=False)
    init = InitSerializer(required=False)
    eval = EvalSerializer(required=False)

    def validate(self, attrs):
        if attrs.get("data") and attrs.get("dataset"):
            raise serializers.ValidationError({"data": "Give dataset or data.mixture, not both."})
        if not attrs.get("data") and not attrs.get("dataset"):
            raise serializers.ValidationError({"dataset": "This field is required."})
        return attrs


class GitSourceSerializer(SpecSerializer):
    """A git repository and the branch, tag or commit to check out on each node."""

    repo = Text(max_length=1024)
    ref = Text(max_length=255)

    def validate_repo(self, value):
        if not re.fullmatch(r"(https://|ssh://|git@)[^\s]+", value):
            raise serializers.ValidationError("Use an https://, ssh:// or git@ repository URL.")
        return value

    def validate_ref(self, value):
        # A ref starting with "-" would be read by git as an option.
        if value.startswith("-") or not re.fullmatch(r"[\w./-]+", value):
            raise serializers.ValidationError("A branch, tag or commit: letters, digits, ./_-.")
        return value


class ArgvField(serializers.ListField):
    """An argument list. A single string is refused: it would need a shell to split it."""

    child = Text(max_length=8192, allow_blank=True)

    def to_internal_value(self, data):
        if isinstance(data, str):
            raise serializers.ValidationError(
                "Give the command as a list of strings (an argument list), never a shell string."
            )
        return super().to_internal_value(data)


class CommandSerializer(SpecSerializer):
    """Your own program: its argument list (no shell) and where its code comes from, git or a
    path on shared storage (one of them)."""

    argv = ArgvField(min_length=1, max_length=512)
    git = GitSourceSerializer(required=False)
    path = Text(max_length=1024, required=False, help_text="The code's path on shared storage.")
    workdir = Text(max_length=1024, required=False)


class NcclSerializer(SpecSerializer):
    """NCCL settings for the job: a profile (default: the pool's) and overrides on top of it."""

    profile = Text(max_length=100, required=False, help_text="An NCCL profile's name.")
    overrides = TextKeyedDictField(
        child=Text(max_length=1024),
        required=False,
        help_text="NCCL variables set on top of the profile; linted at submission.",
    )
    reasons = TextKeyedDictField(
        child=Text(max_length=500),
        required=False,
        help_text="Why an override the linter warns about (a debugging knob...) is kept.",
    )


class EnvField(TextKeyedDictField):
    child = Text(max_length=32768, allow_blank=True)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        bad = sorted(name for name in value if not ENV_NAME.match(name))
        if bad:
            raise serializers.ValidationError(f"Not environment variable names: {', '.join(bad)}.")
        if len(value) > 256:
            raise serializers.ValidationError("At most 256 variables.")
        return value


class JobSubmitSerializer(SpecSerializer):
    """A job to queue: what to run (trainer or command, one of them), on which GPUs, for which
    team, and for how long. Rules that tie fields together (layout against GPUs, tp
    against heads, the team's quota and budget) are checked too; every problem is listed
    in one answer, by field path."""

    name = Text(max_length=100)
    team = serializers.IntegerField(
        min_value=1,
        max_value=2147483647,
        help_text="The team's id; one you may submit for (others do not exist for you).",
    )
    priority = serializers.ChoiceField(choices=PriorityClass.choices, default=PriorityClass.NORMAL)
    time_limit_s = serializers.IntegerField(min_value=60, max_value=30 * 86400)
    max_cost_usd = serializers.DecimalField(
        max_digits=12, decimal_places=2, min_value=0, required=False
    )
    restart_limit = serializers.IntegerField(min_value=0, max_value=100, default=3)
    trainer = TrainerSerializer(required=False)
    command = CommandSerializer(required=False)
    env = EnvField(required=False)
    secrets = serializers.ListField(
        child=serializers.RegexField(ENV_NAME.pattern, max_length=128),
        required=False,
        max_length=64,
        help_text="Names of the team's secrets to inject; values never appear.",
    )
    resources = ResourcesSerializer()
    placement = PlacementSerializer(required=False)
    nccl = NcclSerializer(required=False)


class JobEventSerializer(StrictModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["at", "from_state", "to_state", "reason", "actor_label"]
        read_only_fields = fields


class JobSerializer(SharedFieldsMixin, StrictModelSerializer):
    """A job: its state, resources, placement, timings and the spec it was submitted with."""

    team_slug = serializers.CharField(source="team.slug", read_only=True)
    submitted_by = serializers.CharField(
        source="submitted_by.username", read_only=True, default=None, allow_null=True
    )
    gpus = serializers.IntegerField(read_only=True)
    min_nodes = serializers.IntegerField(
        source="fewest_nodes",
        read_only=True,
        help_text="The fewest nodes an attempt may run on: nodes, unless it has a node range.",
    )
    pool = serializers.CharField(source="pool.slug", read_only=True, default=None, allow_null=True)
    spec = serializers.SerializerMethodField()
    pending_reason = serializers.CharField(
        read_only=True, help_text="Why a pending job waits, from the last scheduling pass."
    )
    estimated_start = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="When a pending job may start, if known."
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "uuid",
            "name",
            "team",
            "team_slug",
            "submitted_by",
            "priority_class",
            "kind",
            "state",
            "state_reason",
            "pending_reason",
            "estimated_start",
            "gpu_type",
            "gpus",
            "nodes",
            "min_nodes",
            "gpus_per_node",
            "dp_replicate",
            "dp_shard",
            "tp",
            "pp",
            "placement",
            "spot_allowed",
            "pool",
            "time_limit_s",
            "max_cost_usd",
            "restart_limit",
            "restarts",
            "queued_at",
            "submitted_at",
            "admitted_at",
            "started_at",
            "finished_at",
            "spec",
        ]
        read_only_fields = fields

    def get_spec(self, job) -> dict:
        return {k: v for k, v in job.spec.items() if k != "fingerprint"}


class NcclVariableSerializer(StrictSerializer):
    name = serializers.CharField()
    value = serializers.CharField()
    source = serializers.ChoiceField(choices=["profile", "job"])
    level = serializers.ChoiceField(choices=["ok", "warning", "error"])
    reason = serializers.CharField()
    kept_because = serializers.CharField()


class NcclEnvironmentSerializer(StrictSerializer):
    pool = serializers.CharField()
    fabric = serializers.CharField()
    nccl_version = serializers.CharField()
    profile = serializers.CharField(allow_null=True)
    ok = serializers.BooleanField()
    problems = serializers.ListField(child=serializers.CharField())
    variables = NcclVariableSerializer(many=True)


class NcclDifferenceSerializer(StrictSerializer):
    name = serializers.CharField()
    rendered = serializers.CharField(allow_null=True, help_text="Null: the plan did not set it.")
    got = serializers.CharField(allow_null=True, help_text="Null: the rank did not have it.")


class RankEnvironmentSerializer(StrictSerializer):
    rank = serializers.IntegerField()
    local_rank = serializers.IntegerField()
    node_rank = serializers.IntegerField(help_text="As the rendezvous numbered the node.")
    node = serializers.CharField(help_text="The node whose run relayed the report.")
    reported_at = serializers.DateTimeField()
    matches = serializers.BooleanField(help_text="Exactly the environment its plan rendered.")
    differences = NcclDifferenceSerializer(many=True)
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        help_text="The NCCL, PyTorch-NCCL and EFA variables the rank started with.",
    )


class RankEnvironmentsSerializer(StrictSerializer):
    attempt = serializers.IntegerField()
    world_size = serializers.IntegerField()
    reported = serializers.IntegerField(help_text="How many ranks have reported.")
    all_match = serializers.BooleanField(
        help_text="Every rank reported, each exactly the rendered environment."
    )
    rendered = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        help_text="What dispatch rendered: the profile, then the job's overrides.",
    )
    ranks = RankEnvironmentSerializer(many=True)


class JobCostSerializer(serializers.Serializer):
    so_far = serializers.CharField(help_text="As metered; a decimal string in `currency`.")
    metered_until = serializers.DateTimeField(allow_null=True)
    per_hour = serializers.CharField(allow_null=True, help_text="The rate of the GPUs it holds.")
    projected = serializers.CharField(
        allow_null=True, help_text="So far + rate × what is left of its time limit."
    )
    projected_low = serializers.CharField(
        allow_null=True, help_text="Before placement: at the cheapest pool it may run in."
    )
    projected_high = serializers.CharField(allow_null=True, help_text="...and at the dearest.")
    cheapest_pool = serializers.CharField()
    currency = serializers.CharField()


class JobDetailSerializer(JobSerializer):
    """A job with its timeline, NCCL environments, cost and checkpoints."""

    events = JobEventSerializer(many=True, read_only=True)
    nccl_environments = serializers.SerializerMethodField(
        help_text="The NCCL environment the job gets on each pool it runs in (or may run in)."
    )
    rank_environments = serializers.SerializerMethodField(
        help_text="The newest attempt's ranks: the NCCL environment each started with, as it "
        "reported it, and how it differs from the one rendered at dispatch; null before the "
        "job has run."
    )
    cost = serializers.SerializerMethodField(help_text="Cost so far and projected.")
    attempt_nodes = serializers.SerializerMethodField(
        help_text="The nodes its newest attempt runs (or ran) on: nodes, or fewer within its "
        "node range (min_nodes); null before its first attempt."
    )
    checkpoints = serializers.SerializerMethodField(
        help_text="Its checkpoints: the newest, the newest verified, storage used, and whether "
        "a verified one is overdue (`watch`); null for command jobs. More under "
        "/api/v1/checkpoint-jobs/{id}/."
    )

    class Meta(JobSerializer.Meta):
        fields = [
            *JobSerializer.Meta.fields,
            "attempt_nodes",
            "events",
            "nccl_environments",
            "rank_environments",
            "cost",
            "checkpoints",
        ]
        read_only_fields = fields

    def get_attempt_nodes(self, job) -> int | None:
        return job_attempt_nodes(job=job)

    @extend_schema_field(NcclEnvironmentSerializer(many=True))
    def get_nccl_environments(self, job) -> list[dict]:
        return [env.as_dict() for env in job_nccl_environments(job=job)]

    @extend_schema_field(RankEnvironmentsSerializer(allow_null=True))
    def get_rank_environments(self, job) -> dict | None:
        environments = job_rank_environments(job=job)
        return environments.as_dict() if environments else None

    @extend_schema_field(JobCostSerializer)
    def get_cost(self, job) -> dict:
        return job_cost(job=job).as_dict()

    @extend_schema_field({"type": "object", "nullable": True, "additionalProperties": True})
    def get_checkpoints(self, job) -> dict | None:
        return job_detail_part("checkpoints", job)


class EvalMetricSerializer(StrictModelSerializer):
    """One held-out evaluation, as the trainer reported it (apps/jobs/trainer_lines.py)."""

    class Meta:
        model = EvalMetric
        fields = ["attempt", "step", "loss", "perplexity", "tokens", "at"]
        read_only_fields = fields


class ReasonSerializer(StrictSerializer):
    reason = Text(max_length=300, required=False, allow_blank=True)


class QueueRowSerializer(StrictSerializer):
    id = serializers.IntegerField(allow_null=True, help_text="Null for other teams' jobs.")
    team = serializers.CharField()
    gpus = serializers.IntegerField()
    gpu_type = serializers.CharField()
    state = serializers.CharField()
    priority = serializers.CharField()
    estimated_start = serializers.DateTimeField(
        allow_null=True,
        help_text="A pending job's: the scheduler's reserved start, else the estimate of the "
        "Queue page's model; null where nothing bounds it.",
    )
    estimate_basis = serializers.CharField(help_text="What the estimated start rests on.")
    position = serializers.IntegerField(allow_null=True)
    anonymous = serializers.BooleanField()
    nodes = serializers.ListField(
        child=serializers.CharField(),
        help_text="The nodes it holds now (empty for other teams' jobs).",
    )
    started_at = serializers.DateTimeField(
        allow_null=True, help_text="Since when it runs, while it holds GPUs."
    )
    name = serializers.CharField(required=False)
    reason = serializers.CharField(required=False)
    submitted_at = serializers.DateTimeField(required=False)


class QueueQuerySerializer(serializers.Serializer):
    """The queue's filters (its pages are `page` and `page_size`, as every list's)."""

    state = serializers.ChoiceField(
        choices=sorted(ACTIVE_STATES), required=False, help_text="Only jobs in this state."
    )
    team = serializers.SlugField(required=False, help_text="Only this team's jobs (its slug).")


class ReservationSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to, required=False, allow_null=True)
    nodes = serializers.PrimaryKeyRelatedField(many=True, queryset=Node.objects.all())

    class Meta:
        model = Reservation
        fields = ["id", "name", "team", "reason", "nodes", "starts_at", "ends_at", "created_at"]
        read_only_fields = ["created_at"]


class WebhookSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    job = ScopedPrimaryKeyField(selector=jobs_visible_to, required=False, allow_null=True)

    class Meta:
        model = Webhook
        fields = ["id", "team", "job", "url", "active", "created_at"]
        read_only_fields = ["active", "created_at"]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["url"] = webhook_url_seen_by(webhook=instance, user=self.context["request"].user)
        return data


class WebhookCreatedSerializer(WebhookSerializer):
    signing_key = serializers.CharField(
        read_only=True,
        help_text="Shown once: check X-Controlplane-Signature (sha256 HMAC of the body) with it.",
    )

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "signing_key"]


class DatasetSerializer(StrictModelSerializer):
    """A registered dataset: where it lives, its tokenizer and sizes, and its index."""

    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    team_slug = serializers.CharField(source="team.slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Dataset
        fields = [
            "id",
            "team",
            "team_slug",
            "name",
            "uri",
            "tokenizer_name",
            "tokenizer_sha256",
            "vocab_size",
            "shards",
            "tokens",
            "documents",
            "bytes",
            "index",
            "index_sha256",
            "created_by",
            "created_at",
        ]
        read_only_fields = [f for f in fields if f not in ("team", "name", "uri", "index")]
        # The service checks the name (unique in the team), the URI and the index, with a
        # 400 naming the field.
        validators = []
        extra_kwargs = {"name": {"validators": []}}


class LogQuerySerializer(StrictSerializer):
    after = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False, default=0)
    limit = serializers.IntegerField(min_value=1, max_value=1000, required=False, default=500)
    # The Job page's log viewer's filters, by the same names (selectors._log_filtered).
    rank = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    attempt = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    q = Text(source="text", required=False, allow_blank=True, max_length=LOG_SEARCH_MAX, default="")
    # Pagination and format parameters the API's other lists accept are not for this view.
    format = serializers.CharField(required=False)


class LogLineSerializer(StrictSerializer):
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    rank = serializers.IntegerField(help_text="The node rank the line came from.")
    attempt = serializers.IntegerField()
    stream = serializers.CharField(help_text="stdout, stderr, or agent (the agent's own notes).")
    text = serializers.CharField()


class JobLogSerializer(StrictSerializer):
    lines = LogLineSerializer(many=True)
    next_after = serializers.IntegerField(help_text="Ask again with after=this to follow.")
    finished = serializers.BooleanField(help_text="The job has ended: no more lines will come.")
    state = serializers.CharField()


class MemoryLinesSerializer(StrictSerializer):
    """GiB per GPU at the peak, line by line; they add up to total_gib."""

    parameters = serializers.FloatField(help_text="fp32 master weights, this GPU's share.")
    copies = serializers.FloatField(help_text="bf16 weights the step computes with.")
    gradients = serializers.FloatField(help_text="fp32 gradients held at the peak.")
    optimizer = serializers.FloatField(help_text="AdamW's two moments.")
    activations = serializers.FloatField(help_text="Saved for the backward pass.")
    output = serializers.FloatField(help_text="The logits and the loss's working copies.")
    buffers = serializers.FloatField(help_text="DDP's gradient buckets, cuBLAS workspaces.")
    runtime = serializers.FloatField(help_text="CUDA context, NCCL buffers, fragmentation.")


class LayoutAdviceSerializer(StrictSerializer):
    layout = serializers.CharField(help_text="dp_replicate x dp_shard x tp x pp.")
    label = serializers.CharField()
    fit = serializers.ChoiceField(
        choices=["fits", "tight", "no"],
        help_text="tight: within 10% of the GPU's memory; no: does not fit.",
    )
    memory_gib = serializers.FloatField(help_text="Total per GPU, the runtime included.")
    allocated_gib = serializers.FloatField(
        help_text="What torch's allocator will hold at the peak (the trainer's peak_mem_gib)."
    )
    gpu_memory_gib = serializers.FloatField()
    peak_rank = serializers.CharField(help_text="The rank whose peak this is.")
    lines = MemoryLinesSerializer()
    step_time_s = serializers.FloatField(allow_null=True)
    run_time_s = serializers.FloatField(allow_null=True, help_text="The steps plus start-up.")
    cost = serializers.CharField(allow_null=True, help_text="A decimal string in USD.")
    within_time_limit = serializers.BooleanField()


class AdviceSerializer(StrictSerializer):
    gpu_type = serializers.CharField()
    gpus = serializers.IntegerField()
    layouts = LayoutAdviceSerializer(many=True)
    chosen = LayoutAdviceSerializer(
        allow_null=True, help_text="The layout the spec asks for, as estimated."
    )
    suggested = LayoutAdviceSerializer(
        allow_null=True, help_text="The cheapest layout that fits and ends within the time limit."
    )
    basis = serializers.ListField(
        child=serializers.CharField(), help_text="What the time and cost rest on."
    )


def advice_data(advice) -> dict:
    """An apps.jobs.advisor.Advice as AdviceSerializer's fields."""

    def one(a):
        if a is None:
            return None
        figures = a.estimate.as_dict()
        return {
            "layout": a.layout.value,
            "label": a.layout.label,
            "fit": a.fit,
            "memory_gib": figures["total_gib"],
            "allocated_gib": figures["allocated_gib"],
            "gpu_memory_gib": a.gpu_memory_gib,
            "peak_rank": figures["rank"],
            "lines": figures["lines"],
            "step_time_s": round(a.step_time_s, 4) if a.step_time_s is not None else None,
            "run_time_s": round(a.run_time_s) if a.run_time_s is not None else None,
            "cost": str(round(a.cost, 2)) if a.cost is not None else None,
            "within_time_limit": a.within(advice.time_limit_s),
        }

    return {
        "gpu_type": advice.gpu_type,
        "gpus": advice.gpus,
        "layouts": [one(a) for a in advice.layouts],
        "chosen": one(advice.chosen),
        "suggested": one(advice.suggested),
        "basis": advice.basis,
    }


# --- NCCL tuning runs (apps/jobs/tuning_runs.py, apps/tuning/runs.py) ----------------------------


class TuningRunStartSerializer(StrictSerializer):
    """A tuning run to start on a pool: ops only. What is left out takes the defaults of
    apps/tuning/runs.py (every operation, 1 KiB to 1 GiB, the trainer's gradient bucket sizes
    as the sizes that matter, 5 rounds, ops' approval required)."""

    pool = Text(max_length=100, help_text="The pool's slug or id.")
    nodes = serializers.ListField(
        child=Text(max_length=100),
        required=False,
        max_length=1000,
        help_text="Node names of the pool; default: every ready or busy node of it.",
    )
    team = Text(
        max_length=100,
        required=False,
        help_text="The team (slug or id) whose GPU time it counts to; default: your first.",
    )
    candidates = serializers.ListField(
        child=EnvironmentField(),
        required=False,
        max_length=50,
        help_text="Your own candidates, each a map of NCCL variables to values, measured "
        "with the generated ones; each must pass the linter.",
    )
    rounds = serializers.IntegerField(required=False, min_value=1, max_value=1000)
    ops = serializers.ListField(
        child=serializers.ChoiceField(choices=list(tuning_runs.OPS)),
        required=False,
        max_length=len(tuning_runs.OPS),
    )
    sizes = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=2**40),
        required=False,
        max_length=64,
        help_text="Message sizes in bytes: powers of two from 1 KiB to 1 GiB.",
    )
    sizes_that_matter = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=2**40),
        required=False,
        max_length=64,
        help_text="Where a candidate must be faster beyond the noise to be adopted.",
    )
    approval_required = serializers.BooleanField(
        required=False, help_text="Whether adoption waits for ops to approve (default yes)."
    )
    priority = serializers.ChoiceField(choices=PriorityClass.choices, required=False)
    limit = serializers.IntegerField(
        required=False, min_value=1, max_value=100, help_text="At most this many candidates."
    )

    def validate(self, attrs):
        # A slug or an id, as the services take them.
        for name in ("pool", "team"):
            if name in attrs and attrs[name].isdigit():
                attrs[name] = int(attrs[name])
        return attrs


class TuningProgressSerializer(StrictSerializer):
    done = serializers.IntegerField(help_text="Launches measured (one per setting and round).")
    total = serializers.IntegerField()
    percent = serializers.FloatField()
    eta_s = serializers.IntegerField(
        allow_null=True, help_text="Seconds left at the pace so far; null unless running."
    )


class TuningCandidateSerializer(StrictSerializer):
    index = serializers.IntegerField(help_text="0 is the baseline.")
    label = serializers.CharField()
    changes = serializers.DictField(child=serializers.CharField())
    origin = serializers.CharField(help_text="baseline, generated or ops.")


class AdoptedVersionSerializer(StrictSerializer):
    profile = serializers.CharField(source="profile.name")
    number = serializers.IntegerField()


class TuningRunEventSerializer(StrictSerializer):
    at = serializers.DateTimeField()
    from_state = serializers.CharField()
    to_state = serializers.CharField()
    reason = serializers.CharField()
    actor_label = serializers.CharField()


class TuningRunSerializer(StrictSerializer):
    """A tuning run: what it measures, where, how far it is, and what it adopted."""

    id = serializers.IntegerField()
    kind = serializers.ChoiceField(choices=TuningRunKind.choices)
    pool = serializers.CharField(source="pool.slug", help_text="The pool's slug.")
    pool_id = serializers.IntegerField()
    nodes = serializers.ListField(child=serializers.CharField(), source="node_names")
    job = serializers.IntegerField(source="job_id", allow_null=True)
    state = serializers.ChoiceField(choices=TuningRunState.choices)
    reason = serializers.CharField(source="state_reason")
    progress = serializers.SerializerMethodField()
    rounds = serializers.IntegerField()
    approval_required = serializers.BooleanField()
    adopted_version = AdoptedVersionSerializer(allow_null=True)
    created_at = serializers.DateTimeField()
    created_by = serializers.CharField(source="created_by.username", default=None, allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    decided_by = serializers.CharField(source="decided_by.username", default=None, allow_null=True)

    @extend_schema_field(TuningProgressSerializer)
    def get_progress(self, run) -> dict:
        return tuning_run_progress(run)


class TuningRunDetailSerializer(TuningRunSerializer):
    candidates = TuningCandidateSerializer(many=True)
    ops = serializers.ListField(child=serializers.CharField())
    sizes = serializers.ListField(child=serializers.IntegerField(), help_text="Bytes.")
    sizes_that_matter = serializers.ListField(child=serializers.IntegerField())
    result = serializers.JSONField(
        allow_null=True,
        help_text="Once judged: the chosen candidate's index (null: none), the reason, and "
        "each candidate's verdict by label, with its change per operation and size.",
    )
    events = TuningRunEventSerializer(many=True)


class TuningFigureSerializer(StrictSerializer):
    candidate = serializers.IntegerField()
    label = serializers.CharField()
    baseline = serializers.BooleanField()
    op = serializers.CharField()
    bytes = serializers.IntegerField()
    median_busbw_gbps = serializers.FloatField(help_text="The median over the rounds.")
    busbw_gbps = serializers.ListField(
        child=serializers.FloatField(allow_null=True),
        help_text="Each round's bus bandwidth, GB/s, in round order (null: no figure).",
    )


class TuningFiguresSerializer(StrictSerializer):
    run = serializers.IntegerField()
    rounds = serializers.IntegerField()
    figures = TuningFigureSerializer(many=True)
