"""What the bundled trainer prints for the control plane to read: JSON lines with an "event"
key among a run's output. The one parser of them on this side (the agent ships apart and
keeps its own)."""

import json
import math
import re

from apps.jobs.models import EvalMetric, LogLine, RankEnvironment, Run, StepMetric
from apps.jobs.specs import NCCL_ENV_PREFIXES


def int_or_none(value) -> int | None:
    """A whole number as JSON gave it, or None (a bool is not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


STEP_FIELDS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_gib")


def trainer_event(text: str) -> dict | None:
    """A line the bundled trainer printed for us: a JSON object with an "event" key."""
    if not text.startswith("{") or '"event"' not in text[:40]:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # a job prints what it likes
        return None
    return data if isinstance(data, dict) and isinstance(data.get("event"), str) else None


def step_metric(run: Run, line: LogLine) -> StepMetric | None:
    """The trainer's per-step line, `{"event":"step","step":12,"loss":3.1,...}`."""
    data = trainer_event(line.text)
    if data is None or data["event"] != "step":
        return None
    step = data.get("step")
    if not isinstance(step, int) or not 0 <= step < 2**31:
        return None

    return StepMetric(
        job_id=run.job_id,
        attempt=run.attempt,
        step=step,
        at=line.at,
        **{name: finite_or_none(data.get(name)) for name in STEP_FIELDS},
    )


def finite_or_none(value) -> float | None:
    """A finite JSON number as a float, or None (json.loads reads NaN and Infinity)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


# A held-out loss past this is no cross-entropy of a real vocabulary (ln 2**31 is about 21.5;
# a diverged model's can be larger, but not a thousand); exp(EVAL_LOSS_MAX) still fits a float.
EVAL_LOSS_MAX = 700.0


def eval_metric(run: Run, line: LogLine) -> EvalMetric | None:
    """The trainer's evaluation line, `{"event":"eval","step":100,"loss":2.9,"perplexity":18.2,
    "tokens":65536,...}` (workers/trainer/evaluation.py). Dropped unless its step is a step
    and its loss a finite loss from 0 to EVAL_LOSS_MAX; a perplexity that is not exp(loss)
    within rounding, or a token count that is not a whole number, is left out of the row."""
    data = trainer_event(line.text)
    if data is None or data["event"] != "eval":
        return None
    step = int_or_none(data.get("step"))
    loss = finite_or_none(data.get("loss"))
    if step is None or not 0 <= step < 2**31 or loss is None or not 0 <= loss <= EVAL_LOSS_MAX:
        return None
    perplexity = finite_or_none(data.get("perplexity"))
    if perplexity is not None and not math.isclose(perplexity, math.exp(loss), rel_tol=1e-3):
        perplexity = None
    tokens = int_or_none(data.get("tokens"))
    return EvalMetric(
        job_id=run.job_id,
        attempt=run.attempt,
        step=step,
        at=line.at,
        loss=loss,
        perplexity=perplexity,
        tokens=tokens if tokens is not None and 0 <= tokens < 2**63 else None,
    )


MAX_RANK_VARIABLES = 256
_VARIABLE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,127}\Z")


def _storable(value) -> bool:
    """A string PostgreSQL's JSON keeps: no NUL, no lone surrogate (both parse from escapes)."""
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def rank_environment(run: Run, line: LogLine) -> RankEnvironment | None:
    """A rank's `{"event":"env","rank":3,"local_rank":1,"node_rank":1,"env":{...}}`: kept only
    when the rank, local rank and node rank fit the job's world and `env` is a mapping of
    names to strings; of it, only NCCL, PyTorch-NCCL and EFA variables."""
    data = trainer_event(line.text)
    if data is None or data["event"] != "env":
        return None
    job = run.job
    rank, local_rank, node_rank = (
        int_or_none(data.get(key)) for key in ("rank", "local_rank", "node_rank")
    )
    env = data.get("env")
    if not (
        rank is not None
        and 0 <= rank < job.nodes * job.gpus_per_node
        and local_rank is not None
        and 0 <= local_rank < job.gpus_per_node
        and node_rank is not None
        and 0 <= node_rank < job.nodes
        and isinstance(env, dict)
        and len(env) <= MAX_RANK_VARIABLES
        and all(_storable(value) for value in env.values())
    ):
        return None
    kept = {
        name: value
        for name, value in sorted(env.items())
        if _VARIABLE_NAME.match(name) and name.startswith(NCCL_ENV_PREFIXES)
    }
    return RankEnvironment(
        job_id=run.job_id,
        run=run,
        attempt=run.attempt,
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        env=kept,
        reported_at=line.at,
    )


STAGE_COUNTS = ("files_done", "files", "bytes_done", "bytes", "reused_bytes")


def stage_progress(text: str) -> dict | None:
    """workers.trainer.stage's progress, `{"event":"stage","dataset","files_done","files",
    "bytes_done","bytes","reused_bytes"}` (or `in_place` for a shared path), its end, or its
    failure: kept field by field, as a job prints what it likes."""
    data = trainer_event(text)
    if data is None or data["event"] not in ("stage", "stage_end", "stage_failed"):
        return None
    kept = {"event": data["event"]}
    for key in ("dataset", "message"):
        if _storable(data.get(key)):
            kept[key] = data[key][:300]
    for key in STAGE_COUNTS:
        value = int_or_none(data.get(key))
        if value is not None and 0 <= value < 2**63:
            kept[key] = value
    if data.get("in_place") is True:
        kept["in_place"] = True
    return kept
