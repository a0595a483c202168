"""The Submit page's form: a person's view of the job spec, turned into the API's spec; and
the form that starts an NCCL tuning run.

The forms read types only; what they make goes through the services (the submit serializer
and service; tuning_run_start), whose errors land back on the form's fields."""

import re

from django import forms

from apps.accounts.models import Team
from apps.accounts.selectors import roles_of, team_secrets_visible_to
from apps.jobs.api.serializers import ATTENTION_BACKENDS, PIPELINE_SCHEDULES
from apps.jobs.models import Placement, PriorityClass
from apps.jobs.models.jobs import JOB_GPU_TYPES
from apps.jobs.specs import FP8_GPU_TYPES
from workers.trainer.presets import PRESETS

GPU_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CUSTOM_MODEL = "custom"

# Spec fields the form asks for in another unit: their errors say which unit they count in.
SPEC_UNITS = {"time_limit_s": "seconds (this field is in hours; 1 h = 3,600 s)"}

# Trainer settings passed on only when given: the trainer's defaults hold otherwise. The
# form's field has the spec's name.
TRAINER_OPTIONAL = (
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "checkpoint_keep",
    "checkpoint_keep_every",
    "micro_batch",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "grad_clip",
    "seed",
    "collective_timeout_s",
    "log_every",
    "attention_backend",
)
# Form field: its key in trainer.model (explicit sizes, for the "custom" preset).
MODEL_SIZES = {
    "model_layers": "layers",
    "model_dim": "dim",
    "model_heads": "heads",
    "model_kv_heads": "kv_heads",
    "model_ffn_dim": "ffn_dim",
    "model_vocab_size": "vocab_size",
    "model_max_seq_len": "max_seq_len",
}
# Form field: its key in trainer.pipeline.
PIPELINE = {
    "pipeline_schedule": "schedule",
    "pipeline_microbatches": "microbatches",
    "pipeline_stages_per_rank": "stages_per_rank",
}

# Where an error on a spec field (its path in the API's spec) is shown on the form; a path
# not here shows on its parent's field. Every leaf of JobSubmitSerializer has one (a test
# holds them equal), so the form offers everything the API takes.
SPEC_FIELDS = {
    "name": "name",
    "team": "team",
    "priority": "priority",
    "time_limit_s": "time_limit_hours",
    "max_cost_usd": "max_cost_usd",
    "restart_limit": "restart_limit",
    "env": "env",
    "secrets": "secrets",
    "resources": "gpus",
    "resources.gpu_type": "gpu_type",
    "resources.gpus": "gpus",
    "resources.nodes": "gpus",
    "resources.min_nodes": "min_nodes",
    "resources.gpus_per_node": "gpus_per_node",
    "resources.layout": "layout",
    **{f"resources.layout.{part}": "layout" for part in ("dp_replicate", "dp_shard", "tp", "pp")},
    "placement.where": "placement",
    "placement.spot": "spot",
    "trainer": "kind",
    "trainer.preset": "preset",
    "trainer.model": "preset",
    **{f"trainer.model.{key}": field for field, key in MODEL_SIZES.items()},
    "trainer.dataset": "dataset",
    "trainer.data": "dataset",
    "trainer.data.mixture": "dataset",
    "trainer.steps": "steps",
    "trainer.global_batch": "global_batch",
    "trainer.seq_len": "seq_len",
    "trainer.precision": "precision",
    "trainer.activation_checkpointing": "activation_checkpointing",
    "trainer.compile": "compile",
    "trainer.check_memory": "check_memory",
    "trainer.init": "init_hf",
    "trainer.init.hf": "init_hf",
    "trainer.eval": "eval_every",
    "trainer.eval.every": "eval_every",
    "trainer.eval.batches": "eval_batches",
    **{f"trainer.{key}": key for key in TRAINER_OPTIONAL},
    **{f"trainer.pipeline.{key}": field for field, key in PIPELINE.items()},
    # A command without its code's source is told so on the code path, beside git's fields.
    "command": "code_path",
    "command.argv": "argv",
    "command.path": "code_path",
    "command.git": "git_repo",
    "command.git.repo": "git_repo",
    "command.git.ref": "git_ref",
    "command.workdir": "workdir",
    "nccl.profile": "nccl_profile",
    "nccl.overrides": "nccl_overrides",
    "nccl.reasons": "nccl_reasons",
}

# The form's folded parts (<details>): each opens when one of its fields has an error.
SECTIONS = {
    "training": [
        "checkpoint_keep",
        "checkpoint_keep_every",
        "precision",
        "activation_checkpointing",
        "compile",
        *TRAINER_OPTIONAL[4:],
        *PIPELINE,
        "init_hf",
        "eval_every",
        "eval_batches",
    ],
    "nccl": ["nccl_profile", "nccl_overrides", "nccl_reasons"],
}


# Fields the advisor's estimate does not rest on: until they are right it shows all the same.
NOT_ESTIMATED = frozenset(
    {
        "name",
        "team",
        "env",
        "secrets",
        "max_cost_usd",
        "restart_limit",
        "nccl_profile",
        "nccl_overrides",
        "nccl_reasons",
    }
)


class NamedValuesField(forms.CharField):
    """NAME=value, one a line (blank lines skipped): a dict. The names are checked by the
    API's serializer, which says which are wrong."""

    widget = forms.Textarea(attrs={"rows": 3, "spellcheck": "false"})

    def to_python(self, value) -> dict:
        named = {}
        for number, line in enumerate((value or "").splitlines(), start=1):
            if not line.strip():
                continue
            name, equals, text = line.partition("=")
            if not equals:
                raise forms.ValidationError(f"Line {number}: write NAME=value.")
            named[name.strip()] = text
        return named


def _optional_int(**kwargs):
    return forms.IntegerField(required=False, **kwargs)


def _optional_float(**kwargs):
    return forms.FloatField(required=False, **kwargs)


class SubmitForm(forms.Form):
    name = forms.CharField()
    team = forms.ModelChoiceField(queryset=Team.objects.none())
    kind = forms.ChoiceField(
        choices=[("trainer", "Bundled trainer"), ("command", "Custom command")],
        initial="trainer",
    )
    preset = forms.CharField(
        widget=forms.Select(
            choices=[*((p, p) for p in PRESETS), (CUSTOM_MODEL, "Custom sizes (below)")]
        ),
        initial="tiny",
        required=False,
    )
    gpu_type = forms.CharField(widget=forms.Select(choices=JOB_GPU_TYPES), initial="H100")
    gpus = forms.IntegerField(widget=forms.Select(choices=[(n, n) for n in GPU_COUNTS]), initial=8)
    gpus_per_node = forms.IntegerField(initial=8)
    min_nodes = _optional_int(
        label="Fewest nodes",
        help_text="Run on fewer nodes when all of them do not fit (default: all).",
    )
    layout = forms.CharField(required=False, help_text="dp_replicate × dp_shard × tp × pp")
    check_memory = forms.BooleanField(
        required=False,
        initial=True,
        label="Refuse if the memory model says it does not fit",
        help_text="Off: submit it anyway (say, for settings the model does not know).",
    )
    priority = forms.CharField(
        widget=forms.Select(choices=PriorityClass.choices), initial=PriorityClass.NORMAL
    )
    placement = forms.CharField(
        widget=forms.Select(choices=Placement.choices), initial=Placement.OWNED_THEN_CLOUD
    )
    spot = forms.BooleanField(required=False, label="Spot allowed")
    time_limit_hours = forms.DecimalField(max_digits=12, initial=4)
    max_cost_usd = forms.DecimalField(
        required=False,
        label="Maximum cost (USD)",
        help_text="Refused at submission if its projected cost is above this.",
    )
    restart_limit = _optional_int(
        initial=3, label="Restarts", help_text="Requeued after a failure at most this often."
    )
    dataset = forms.CharField(
        initial="synthetic",
        required=False,
        help_text="A token file path on shared storage, 'synthetic', or registered datasets "
        "of the team mixed by weight: wiki-en=0.7, books=0.3.",
    )
    steps = forms.IntegerField(initial=1000, required=False)
    global_batch = forms.IntegerField(initial=64, required=False)
    seq_len = forms.IntegerField(initial=512, required=False)
    checkpoint_every_steps = _optional_int(
        label="Checkpoint every (steps)", help_text="Blank: only at the end."
    )
    checkpoint_every_minutes = _optional_int(
        label="Checkpoint every (minutes)", help_text="Blank: only at the end."
    )
    checkpoint_keep = _optional_int(label="Checkpoints kept", help_text="The newest (default 3).")
    checkpoint_keep_every = _optional_int(
        label="Also keep every", help_text="...checkpoint whose step is a multiple of this."
    )
    precision = forms.ChoiceField(
        choices=[("bf16", "bf16"), ("fp32", "fp32"), ("fp8", f"fp8 ({'/'.join(FP8_GPU_TYPES)})")],
        initial="bf16",
        required=False,
        help_text="fp8: bf16 with the blocks' linear layers in float8; "
        f"{' or '.join(FP8_GPU_TYPES)} only, without tensor parallelism (tp 1).",
    )
    activation_checkpointing = forms.ChoiceField(
        choices=[("none", "none"), ("selective", "selective"), ("full", "full")],
        initial="selective",
        required=False,
    )
    compile = forms.BooleanField(required=False, label="torch.compile")
    micro_batch = _optional_int(help_text="Sequences per forward pass on one rank.")
    lr = _optional_float(label="Learning rate")
    warmup_steps = _optional_int(label="Warm-up steps")
    min_lr_ratio = _optional_float(label="Final learning rate ratio")
    grad_clip = _optional_float(label="Gradient clip")
    seed = _optional_int()
    collective_timeout_s = _optional_int(label="Collective timeout (seconds)")
    log_every = _optional_int(label="Log every (steps)")
    attention_backend = forms.ChoiceField(
        choices=[("", "trainer's default"), *((b, b) for b in ATTENTION_BACKENDS)],
        required=False,
    )
    eval_every = _optional_int(
        label="Evaluate every (steps)",
        help_text="Loss and perplexity on the datasets' held-out split; blank: never.",
    )
    eval_batches = _optional_int(label="Evaluation batches", help_text="Global batches (1).")
    init_hf = forms.CharField(
        required=False,
        max_length=1024,
        label="Start from Hugging Face weights",
        help_text="A Llama directory (config.json, safetensors) on a path every node mounts, "
        "or s3://bucket/prefix/ (copied to each node first); its sizes must be the model's.",
    )
    pipeline_schedule = forms.ChoiceField(
        choices=[("", "1f1b (default)"), *((s, s) for s in PIPELINE_SCHEDULES)],
        required=False,
        label="Pipeline schedule",
    )
    pipeline_microbatches = _optional_int(label="Pipeline micro-batches")
    pipeline_stages_per_rank = _optional_int(label="Stages per rank")
    model_layers = _optional_int(label="Layers")
    model_dim = _optional_int(label="Model width")
    model_heads = _optional_int(label="Heads")
    model_kv_heads = _optional_int(label="KV heads")
    model_ffn_dim = _optional_int(label="FFN width")
    model_vocab_size = _optional_int(label="Vocabulary")
    model_max_seq_len = _optional_int(label="Longest sequence")
    argv = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}),
        required=False,
        label="Command",
        help_text="One argument per line (no shell).",
    )
    code_path = forms.CharField(
        required=False,
        label="Code path",
        help_text="The code's path on shared storage; or give a git source instead.",
    )
    git_repo = forms.CharField(
        required=False, label="Git repository", help_text="https://, ssh:// or git@ URL."
    )
    git_ref = forms.CharField(required=False, label="Git ref", help_text="A branch, tag or commit.")
    workdir = forms.CharField(required=False, label="Working directory")
    env = NamedValuesField(required=False, label="Environment", help_text="NAME=value, one a line.")
    secrets = forms.MultipleChoiceField(
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Team secrets",
        help_text="Set as environment variables by name; values never appear.",
    )
    nccl_profile = forms.CharField(
        required=False, label="NCCL profile", help_text="Blank: the pool's own."
    )
    nccl_overrides = NamedValuesField(
        required=False,
        label="NCCL overrides",
        help_text="NCCL_NAME=value, one a line; linted at submission.",
    )
    nccl_reasons = NamedValuesField(
        required=False,
        label="Why kept",
        help_text="NCCL_NAME=why, for an override the linter warns about.",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        roles = roles_of(user)
        teams = Team.objects.order_by("name")
        if not roles.superuser:
            teams = teams.filter(id__in=[t for t in roles.team_ids if roles.can_submit_for(t)])
        team_list = list(teams)
        self.fields["team"].queryset = teams
        if len(team_list) == 1:  # nothing to choose: the only team, chosen
            self.fields["team"].initial = team_list[0].pk
            self.fields["team"].empty_label = None
        self.fields["secrets"].choices = _secret_choices(user, team_list)

    @property
    def open_sections(self) -> set[str]:
        """The folded parts to show open: those with an error on one of their fields."""
        return {
            section
            for section, names in SECTIONS.items()
            if any(name in self.errors for name in names)
        }

    def clean_layout(self):
        value = self.cleaned_data.get("layout", "").strip()
        if not value:
            return ""
        parts = value.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise forms.ValidationError(
                "Choose a layout: dp_replicate x dp_shard x tp x pp, each at least 1."
            )
        return value

    def to_spec(self) -> dict:
        """The body the API takes, so both go through one set of rules."""
        data = self.cleaned_data
        spec = {
            "name": data["name"],
            "team": data["team"].pk,
            "priority": data["priority"],
            "time_limit_s": int(data["time_limit_hours"] * 3600),
            "resources": self._resources(),
            "placement": {"where": data["placement"], "spot": data["spot"]},
        }
        if data.get("restart_limit") is not None:
            spec["restart_limit"] = data["restart_limit"]
        if data.get("max_cost_usd") is not None:
            spec["max_cost_usd"] = str(data["max_cost_usd"])
        if data["kind"] == "trainer":
            spec["trainer"] = self._trainer()
        else:
            spec["command"] = self._command()
        if data.get("env"):
            spec["env"] = data["env"]
        if data.get("secrets"):
            spec["secrets"] = data["secrets"]
        nccl = _given(
            {
                "profile": data.get("nccl_profile"),
                "overrides": data.get("nccl_overrides"),
                "reasons": data.get("nccl_reasons"),
            }
        )
        if nccl:
            spec["nccl"] = nccl
        return spec

    def estimate_spec(self) -> dict | None:
        """The spec to_spec makes, for the advisor, once the fields it rests on are valid:
        a name and team are not needed yet (the first team the user submits for stands in),
        nor what it has no bearing on. None before then, or for a command job."""
        self.is_valid()
        if set(self.errors) - NOT_ESTIMATED or self.cleaned_data.get("kind") != "trainer":
            return None
        data = self.cleaned_data
        team = data.get("team") or self.fields["team"].queryset.first()
        if team is None:
            return None
        for name in NOT_ESTIMATED:
            data.pop(name, None)  # the job's own, and maybe not right yet
        data.update(name="estimate", team=team)
        return self.to_spec()

    def _resources(self) -> dict:
        data = self.cleaned_data
        gpus = data["gpus"]
        per_node = min(data["gpus_per_node"], gpus)
        resources = {
            "gpu_type": data["gpu_type"],
            "gpus": gpus,
            "nodes": max(gpus // per_node, 1) if per_node > 0 else 1,
            "gpus_per_node": per_node,
        }
        if data.get("min_nodes") is not None:
            resources["min_nodes"] = data["min_nodes"]
        if data.get("layout"):
            replicate, shard, tp, pp = (int(x) for x in data["layout"].split("x"))
            resources["layout"] = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "pp": pp}
        return resources

    def _trainer(self) -> dict:
        data = self.cleaned_data
        trainer = {
            **_data_source(data.get("dataset") or "synthetic"),
            "steps": data.get("steps") or 1000,
            "global_batch": data.get("global_batch") or 64,
            "seq_len": data.get("seq_len") or 512,
            "compile": data["compile"],
            "check_memory": data["check_memory"],
            **_given({key: data.get(key) for key in TRAINER_OPTIONAL}),
            **_given({key: data.get(key) for key in ("precision", "activation_checkpointing")}),
        }
        if data.get("preset") == CUSTOM_MODEL:
            trainer["model"] = _given({key: data.get(field) for field, key in MODEL_SIZES.items()})
        else:
            trainer["preset"] = data.get("preset") or "tiny"
        pipeline = _given({key: data.get(field) for field, key in PIPELINE.items()})
        if pipeline:
            trainer["pipeline"] = pipeline
        if data.get("init_hf"):
            trainer["init"] = {"hf": data["init_hf"].strip()}
        if data.get("eval_every"):
            trainer["eval"] = _given(
                {"every": data["eval_every"], "batches": data.get("eval_batches")}
            )
        return trainer

    def _command(self) -> dict:
        data = self.cleaned_data
        argv = [line.strip() for line in (data.get("argv") or "").splitlines() if line.strip()]
        command = {"argv": argv, **_given({"path": data.get("code_path")})}
        git = _given({"repo": data.get("git_repo"), "ref": data.get("git_ref")})
        if git:
            command["git"] = git
        if data.get("workdir"):
            command["workdir"] = data["workdir"]
        return command

    def add_spec_errors(self, errors: dict, path: str = "") -> None:
        """The submit serializer's or service's errors (nested by the spec's shape, or keyed
        by dotted paths) on the fields that made them; one with no such field at the top,
        named by its path."""
        for key, problems in errors.items():
            # DRF files an error on a whole part under "non_field_errors": the part's own.
            special = key in ("non_field_errors", "__all__")
            where = path if special else ".".join(filter(None, [path, key]))
            if isinstance(problems, dict):
                self.add_spec_errors(problems, where)
                continue
            if isinstance(problems, list) and problems and isinstance(problems[0], dict):
                for index, item in enumerate(problems):
                    self.add_spec_errors(item, f"{where}.{index}")
                continue
            field = _form_field(where)
            for problem in problems if isinstance(problems, list) else [problems]:
                if where in SPEC_UNITS:
                    problem = f"{problem} In {SPEC_UNITS[where]}."
                self.add_error(field, problem if field or not where else f"{where}: {problem}")


def _given(values: dict) -> dict:
    """Those of the values the form was given (blank fields are left to the defaults)."""
    return {key: value for key, value in values.items() if value not in (None, "", {}, [])}


def _secret_choices(user, teams: list[Team]) -> list[tuple[str, str]]:
    """The names of the secrets of the teams the user submits for, each with its teams when
    there are several (the job's team must have the one it names)."""
    secrets = team_secrets_visible_to(user=user).filter(team__in=[t.pk for t in teams])
    holders: dict[str, list[str]] = {}
    for name, team in secrets.order_by("name", "team__slug").values_list("name", "team__slug"):
        holders.setdefault(name, []).append(team)
    if len(teams) <= 1:
        return [(name, name) for name in holders]
    return [(name, f"{name} ({', '.join(slugs)})") for name, slugs in holders.items()]


_PART = r"[a-z0-9][a-z0-9_-]*\s*=\s*[^,\s]+"
_MIXTURE = re.compile(rf"\s*{_PART}(\s*,\s*{_PART})*\s*")


def _data_source(text: str) -> dict:
    """The spec's data: `name=weight, ...` names registered datasets (data.mixture); anything
    else is a token file path or 'synthetic'."""
    if not _MIXTURE.fullmatch(text):
        return {"dataset": text}
    mixture = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = (x.strip() for x in part.partition("="))
        try:
            mixture.append({"dataset": name, "weight": float(weight)})
        except ValueError:
            return {"dataset": text}  # the API's serializer says what is wrong with it
    return {"data": {"mixture": mixture}}


def _form_field(path: str) -> str | None:
    """The form field an error at this spec path belongs on: the path's, or its parent's."""
    while path:
        if path in SPEC_FIELDS:
            return SPEC_FIELDS[path]
        path = path.rpartition(".")[0]
    return None


# --- NCCL tuning runs ------------------------------------------------------------------------


def parse_candidates(text: str) -> tuple[list[dict[str, str]], list[str]]:
    """Ops' own candidates, one a line: `NCCL_ALGO=Tree, NCCL_PROTO=Simple`. Returns the
    candidates and a problem per line that is not such pairs (blank lines and # comments
    are skipped)."""
    found, problems = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        changes = {}
        for pair in line.split(","):
            name, equals, value = pair.strip().partition("=")
            if not equals or not name.strip() or not value.strip():
                problems.append(f"Line {number}: {pair.strip() or '(empty)'} is not NAME=VALUE.")
                break
            changes[name.strip()] = value.strip()
        else:
            found.append(changes)
    return found, problems


class TuningRunForm(forms.Form):
    """What ops choose for a tuning run; the plan's checks are the service's
    (apps/jobs/tuning_runs.py tuning_run_start), whose errors land on these fields."""

    pool = forms.ChoiceField()
    nodes = forms.CharField(
        required=False,
        help_text="Node names of that pool, separated by commas or spaces; "
        "blank: every node of the pool that is ready or busy.",
    )
    rounds = forms.IntegerField(
        initial=5, help_text="Each round measures the baseline and every candidate once."
    )
    limit = forms.IntegerField(
        label="Candidates (at most)",
        initial=12,
        min_value=1,
        max_value=50,
        help_text="Yours first, then variations from the catalogue for the pool's fabric.",
    )
    candidates = forms.CharField(
        label="Your own candidates",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        help_text="One candidate a line: NAME=VALUE pairs separated by commas.",
    )
    approval_required = forms.BooleanField(
        required=False, initial=True, help_text="A candidate the rule adopts waits for ops."
    )
    team = forms.ChoiceField(
        required=False, help_text="Whose GPU time it counts to; blank: your first team."
    )

    def __init__(self, *args, pools: list[tuple[str, str]], teams: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["pool"].choices = pools
        self.fields["team"].choices = [("", "My first team")] + [(t, t) for t in teams]

    def clean_candidates(self) -> list[dict[str, str]]:
        found, problems = parse_candidates(self.cleaned_data.get("candidates") or "")
        if problems:
            raise forms.ValidationError(problems)
        return found

    def to_plan(self) -> dict:
        data = self.cleaned_data
        names = [n for n in data["nodes"].replace(",", " ").split() if n]
        return {
            "pool": data["pool"],
            "nodes": names or None,
            "team": data["team"] or None,
            "rounds": data["rounds"],
            "limit": data["limit"],
            "candidates": data["candidates"],
            "approval_required": data["approval_required"],
        }

    def add_service_errors(self, details: dict) -> None:
        """The service's details ({"rounds": [...], "candidates.NCCL_ALGO": [...]}) on the
        field they name (`candidates.NAME` on candidates, with the name)."""
        for key, problems in details.items():
            field, _, variable = key.partition(".")
            target = field if field in self.fields else None
            for problem in problems if isinstance(problems, list) else [problems]:
                self.add_error(target, f"{variable}: {problem}" if variable else str(problem))
