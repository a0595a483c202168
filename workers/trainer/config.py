"""run.json: what one attempt of a training job is asked to do (no torch here).

The control plane writes the file (apps/jobs/runconfig.py) and this module
reads it; every field has a default, so a hand-written file for a laptop can
be a few lines. Unknown keys are refused, so a misspelt setting fails the run
at once instead of being ignored for a day of training.

    {
      "job": {"id": 7, "uuid": "…", "attempt": 1, "name": "…"},          # for the record
      "model": {"preset": "tiny"} or {"sizes": {"layers": …, "dim": …, …}},
      "data": {"dataset": "/data/tokens.bin", a prepared dataset's directory, or "synthetic",
               "seq_len": 2048,
               # or, in place of dataset, several with weights (data.py says how they mix):
               "mixture": [{"path": "/data/web-en", "weight": 3, "name": "web-en"}, …],
               "eval": null},              # what to evaluate on (below); null: the mixture's
      "eval": {"every": 500, "batches": 20},      # 0: never (see Evaluation)
      "schedule": {"steps": 1000, "global_batch": 64, "micro_batch": null,
                   "lr": 3e-4, "min_lr_ratio": 0.1, "warmup_steps": 100,
                   "weight_decay": 0.1, "grad_clip": 1.0},
      "precision": "bf16",                        # bf16 (GPUs; CPUs train in fp32), fp32 or fp8
      "activation_checkpointing": "selective",    # none, selective or full
      "compile": false,                           # torch.compile each block and the loss
      "attention_backend": "auto",                # GPU SDPA kernel: auto, flash, cudnn, efficient
      "kernels": {"fused_projections": false, …},  # see Kernels
      "layout": {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1},
      "pipeline": {"schedule": "1f1b", "microbatches": null, "stages_per_rank": 2},
      "checkpoint": {"dir": "/shared/ckpt/job-7", "every_steps": 500, "every_minutes": null,
                     "keep": 3, "resume_from": null, "resume_newest": true, "s3": null},
      "init": {"hf": "/shared/models/llama"},     # starting weights (see Init); none: random
      "seed": 0,
      "collective_timeout_s": 600,
      "log_every": 1
    }
"""

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from workers.trainer.presets import PRESETS, ModelShape

AC_MODES = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b")
# fp8: bf16 mixed precision whose blocks' linear layers multiply in float8 (parallelize.py's
# apply_float8); GPUs with FP8 tensor cores only (compute capability 8.9 on), and no TP yet.
PRECISIONS = ("bf16", "fp32", "fp8")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FLOAT8_MULTIPLE = 16  # float8 matrix products need every dimension a multiple of this
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
COMPILE_SCOPES = ("blocks", "model")


class ConfigError(ValueError):
    """run.json asks for something impossible; the message says which field."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Schedule:
    steps: int = 100
    global_batch: int = 8
    micro_batch: int | None = None  # sequences per forward on one rank; None: the whole local batch
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8


@dataclass(frozen=True)
class Pipeline:
    schedule: str = "1f1b"
    microbatches: int | None = None  # None: pp (1F1B) or pp × stages_per_rank (interleaved)
    stages_per_rank: int = 2  # interleaved 1F1B only


@dataclass(frozen=True)
class S3Copy:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None


@dataclass(frozen=True)
class Checkpointing:
    dir: str | None = None
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int = 3  # 0: the trainer deletes none (the control plane's retention does)
    # A checkpoint directory, or the s3:// URI of one (fetched into dir first).
    resume_from: str | None = None
    # Without resume_from: resume from the newest checkpoint in dir that verifies. The
    # control plane turns this off: it names the checkpoint itself, or none.
    resume_newest: bool = True
    s3: S3Copy | None = None


@dataclass(frozen=True)
class Kernels:
    """How the arithmetic is done on GPUs, not what it computes (bench/RESULTS.md measures each)."""

    fused_projections: bool = False  # q·k·v and gate·up as single products (ignored under TP)
    native_gqa: bool = True  # SDPA's grouped-query attention (flash, math) instead of repeating
    single_gpu_fsdp: bool = False  # one data-parallel rank: FSDP2's bf16 policy, not autocast
    compile_mode: str = "default"  # torch.compile mode for each block
    # What one compiled graph holds: each block, or the whole model with its loss (pp 1 only).
    compile_scope: str = "blocks"
    coordinate_descent_tuning: bool = False  # inductor tunes its generated kernels' launch sizes
    # precision fp8's scales (torchao's recipes): one per tensor (the fastest), one per row,
    # or one per row with the weights' gradient product left in bf16 (the closest to bf16).
    float8_recipe: str = "tensorwise"


@dataclass(frozen=True)
class MixturePart:
    path: str
    weight: float = 1.0
    name: str | None = None  # what checkpoints call it; default: the path's last part

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


@dataclass(frozen=True)
class Data:
    dataset: str = "synthetic"
    seq_len: int = 2048
    mixture: tuple[MixturePart, ...] | None = None  # in place of dataset
    # A token file or prepared dataset (its validation split, if it has one) to evaluate on;
    # None: the validation split of each prepared dataset being trained on.
    eval: str | None = None

    def parts(self) -> tuple[MixturePart, ...]:
        """What is trained on: the mixture, or the one dataset at weight 1."""
        if self.mixture:
            return self.mixture
        name = self.dataset if self.dataset == "synthetic" else None
        return (MixturePart(self.dataset, 1.0, name),)


@dataclass(frozen=True)
class Evaluation:
    """Loss and perplexity on held-out data, every `every` steps and at the end (0: never),
    over `batches` global batches of each evaluated dataset (the same sequences each time)."""

    every: int = 0
    batches: int = 1


@dataclass(frozen=True)
class Init:
    """Where the starting weights come from; without any, the seeded random initialisation.

    hf: a Hugging Face Llama checkpoint directory (config.json and safetensors), read by
    hf.py; its sizes must be those of `model`. A checkpoint the run resumes from wins.
    """

    hf: str | None = None


@dataclass(frozen=True)
class RunConfig:
    model: ModelShape
    data: Data = field(default_factory=Data)
    schedule: Schedule = field(default_factory=Schedule)
    layout: Layout = field(default_factory=Layout)
    pipeline: Pipeline = field(default_factory=Pipeline)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    eval: Evaluation = field(default_factory=Evaluation)
    precision: str = "bf16"
    activation_checkpointing: str = "none"
    compile: bool = False
    attention_backend: str = "auto"
    kernels: Kernels = field(default_factory=Kernels)
    init: Init = field(default_factory=Init)
    seed: int = 0
    collective_timeout_s: float = 600.0
    log_every: int = 1
    job: dict = field(default_factory=dict)
    model_name: str = "custom"

    @property
    def mixed_precision(self) -> bool:
        """bf16 compute over fp32 weights on GPUs (fp8 too, around its float8 products)."""
        return self.precision in ("bf16", "fp8")

    @property
    def local_batch(self) -> int:
        return self.schedule.global_batch // self.layout.dp


def _section(cls, data, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _model(data: dict) -> tuple[ModelShape, str]:
    data = data or {}
    preset, sizes = data.get("preset"), data.get("sizes")
    if sizes:
        shape = _section(ModelShape, sizes, "model.sizes")
        name = "custom"
    elif preset in PRESETS:
        shape, name = PRESETS[preset], preset
    else:
        raise ConfigError(f"model: name a preset ({', '.join(PRESETS)}) or give sizes")
    problems = shape.problems()
    if problems:
        raise ConfigError("model: " + "; ".join(problems))
    return shape, name


TOP_LEVEL = {
    "job",
    "model",
    "data",
    "schedule",
    "layout",
    "pipeline",
    "checkpoint",
    "eval",
    "precision",
    "activation_checkpointing",
    "compile",
    "attention_backend",
    "kernels",
    "init",
    "seed",
    "collective_timeout_s",
    "log_every",
}


def parse(data: dict) -> RunConfig:
    unknown = sorted(set(data) - TOP_LEVEL)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)}")
    shape, name = _model(data.get("model"))
    checkpoint = dict(data.get("checkpoint") or {})
    s3 = checkpoint.pop("s3", None)
    config = RunConfig(
        model=shape,
        model_name=name,
        data=_data(data.get("data")),
        schedule=_section(Schedule, data.get("schedule"), "schedule"),
        layout=_section(Layout, data.get("layout"), "layout"),
        pipeline=_section(Pipeline, data.get("pipeline"), "pipeline"),
        checkpoint=_section(Checkpointing, checkpoint, "checkpoint"),
        eval=_section(Evaluation, data.get("eval"), "eval"),
        precision=data.get("precision") or "bf16",
        activation_checkpointing=data.get("activation_checkpointing") or "none",
        compile=bool(data.get("compile", False)),
        attention_backend=data.get("attention_backend") or "auto",
        kernels=_section(Kernels, data.get("kernels"), "kernels"),
        init=_section(Init, data.get("init"), "init"),
        seed=int(data.get("seed") or 0),
        collective_timeout_s=float(data.get("collective_timeout_s") or 600),
        log_every=int(data.get("log_every") or 1),
        job=dict(data.get("job") or {}),
    )
    if s3:
        config = _replace_checkpoint(config, s3=_section(S3Copy, s3, "checkpoint.s3"))
    check(config)
    return config


def _data(data) -> Data:
    data = dict(data or {})
    mixture = data.pop("mixture", None)
    section = _section(Data, data, "data")
    if mixture is None:
        return section
    if not isinstance(mixture, list) or not mixture:
        raise ConfigError("data.mixture must be a list of {path, weight}")
    parts = tuple(_section(MixturePart, p, f"data.mixture[{i}]") for i, p in enumerate(mixture))
    if "dataset" in data:
        raise ConfigError("data: give dataset or mixture, not both")
    return replace(section, mixture=parts)


def _replace_checkpoint(config: RunConfig, **changes) -> RunConfig:
    return replace(config, checkpoint=replace(config.checkpoint, **changes))


def _check_float8(config: RunConfig) -> None:
    """What float8 products need: whole weights (no TP) and dimensions in multiples of 16."""
    if config.kernels.float8_recipe not in FLOAT8_RECIPES:
        raise ConfigError(f"kernels.float8_recipe must be one of {', '.join(FLOAT8_RECIPES)}")
    if not tp_allowed(config.layout.tp, precision=config.precision):
        raise ConfigError("precision fp8 needs layout.tp 1 (tensor parallelism is not supported)")
    odd = float8_misfits(config.model, config.data.seq_len)
    if odd:
        sizes = ", ".join(f"{name} {size}" for name, size in odd.items())
        raise ConfigError(f"precision fp8 needs multiples of {FLOAT8_MULTIPLE}: {sizes} are not")


def tp_allowed(tp: int, *, precision: str) -> bool:
    """Whether `precision` runs under tensor parallelism of `tp`: fp8 not yet (its float8
    linear layers are not sharded across tensor-parallel ranks). The control plane's submit
    check and layout choices ask the same."""
    return tp == 1 or precision != "fp8"


def float8_misfits(shape: ModelShape, seq_len: int) -> dict[str, int]:
    """The sizes a float8 matrix product cannot take, by name (the control plane's submit
    check names them too)."""
    sizes = {
        "dim": shape.dim,
        "ffn_dim": shape.ffn_dim,
        "heads × head_dim": shape.heads * shape.head_dim,
        "kv_heads × head_dim": shape.kv_heads * shape.head_dim,
        "data.seq_len": seq_len,
    }
    return {name: size for name, size in sizes.items() if size % FLOAT8_MULTIPLE}


def check(config: RunConfig) -> None:
    """Refuse what cannot run, naming the field; what depends on the world is checked at start."""
    shape, layout, schedule = config.model, config.layout, config.schedule
    if config.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}")
    if config.precision == "fp8":
        _check_float8(config)
    if config.activation_checkpointing not in AC_MODES:
        raise ConfigError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}")
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
    if config.kernels.compile_scope not in COMPILE_SCOPES:
        raise ConfigError(f"kernels.compile_scope must be one of {', '.join(COMPILE_SCOPES)}")
    if config.kernels.compile_scope == "model" and layout.pp > 1:
        raise ConfigError("kernels.compile_scope model needs layout.pp 1 (stages compile by block)")
    if config.pipeline.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline.schedule must be one of {', '.join(PIPELINE_SCHEDULES)}")
    if min(layout.as_dict().values()) < 1:
        raise ConfigError("layout: every dimension must be at least 1")
    if shape.heads % layout.tp or shape.kv_heads % layout.tp:
        raise ConfigError(f"layout.tp {layout.tp} must divide heads and kv_heads")
    if layout.tp > 1 and config.data.seq_len % layout.tp:
        raise ConfigError("data.seq_len must split over layout.tp (sequence parallelism)")
    stages = stage_count(config)
    if layout.pp > 1 and shape.layers % stages:
        raise ConfigError(f"the model's {shape.layers} layers do not split into {stages} stages")
    if schedule.global_batch % layout.dp:
        raise ConfigError(
            f"schedule.global_batch {schedule.global_batch} does not split over {layout.dp} "
            "data-parallel ranks"
        )
    if schedule.micro_batch and config.local_batch % schedule.micro_batch:
        raise ConfigError("schedule.micro_batch must divide the batch of each data-parallel rank")
    if layout.pp > 1 and config.local_batch % microbatches(config):
        raise ConfigError("pipeline.microbatches must divide the batch of each data-parallel rank")
    if config.data.seq_len > shape.max_seq_len:
        raise ConfigError(f"data.seq_len is longer than the model's {shape.max_seq_len}")
    if schedule.steps < 1 or config.log_every < 1:
        raise ConfigError("schedule.steps and log_every must be at least 1")
    parts = config.data.parts()
    if any(not isinstance(p.weight, int | float) or not p.weight > 0 for p in parts):
        raise ConfigError("data.mixture: every weight must be a number above 0")
    if len({p.label for p in parts}) != len(parts):
        raise ConfigError("data.mixture: the datasets need distinct names (give name)")
    if config.eval.every < 0 or config.eval.batches < 1:
        raise ConfigError("eval.every must be 0 or more and eval.batches at least 1")


def stage_count(config: RunConfig) -> int:
    """Pipeline stages in all: one per pipeline rank, stages_per_rank under interleaved 1F1B."""
    pipeline = config.pipeline
    per_rank = pipeline.stages_per_rank if pipeline.schedule == "interleaved_1f1b" else 1
    return config.layout.pp * per_rank


def microbatches(config: RunConfig) -> int:
    pipeline = config.pipeline
    if pipeline.microbatches:
        return pipeline.microbatches
    if pipeline.schedule == "interleaved_1f1b":
        return config.layout.pp * pipeline.stages_per_rank
    return config.layout.pp


def load(path: str | Path) -> RunConfig:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return parse(data)
