"""Hugging Face Llama checkpoints in and out: config.json and safetensors, with no `transformers`.

In (`init: {"hf": PATH}` in run.json): a directory with config.json and either
model.safetensors or the shards named by model.safetensors.index.json. config.json
is mapped onto ModelShape and must agree with the run's model (`shape` below prints
the sizes to give); each tensor is renamed onto the trainer's parameter names and
copied into this rank's parameters, whatever the layout: every rank reads the whole
tensor of each parameter it holds, one tensor at a time from the memory-mapped files,
and keeps its own shard (model.fill, as the random initialisation does), so nothing
needs a collective and a pipeline stage reads only its own blocks.

Out (`python -m workers.trainer.hf export --checkpoint DIR --out OUT`): a committed
checkpoint of any layout (its files checked against the manifest first, DCP gathering
the shards) becomes config.json (LlamaForCausalLM) and safetensors, loadable by
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` without custom code.

Mapping decisions:
- Rotary embeddings: Hugging Face's Llama checkpoints store q_proj and k_proj for the
  "rotate_half" rotation (dimension i paired with i + head_dim/2; their conversion
  script permutes Meta's interleaved pairs into it). model.rotate pairs the halves in
  the same way, so q and k are copied as they are, in both directions.
- Tied embeddings (tie_word_embeddings): the trainer has a separate output head; it
  starts as a copy of the embedding and trains apart from it, and an export writes
  both (tie_word_embeddings false).
- What the trainer's model cannot compute is refused, naming the field: biases, other
  activations, rope scaling (Llama 3.1's "llama3", YaRN...), a head_dim other than
  hidden_size / num_attention_heads, other model types.

An `s3://` init path is never read here: the control plane's run plan stages it into the
node's cache first (workers/trainer/stage.py) and gives run.json the local copy.
"""

import argparse
import json
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from workers.trainer import metrics
from workers.trainer.config import ConfigError
from workers.trainer.model import canonical_name, fill
from workers.trainer.presets import ModelShape

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Shard names as transformers writes them, and the size it splits at by default.
SHARD = "model-{:05d}-of-{:05d}.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Within block i: Hugging Face's name after `model.layers.{i}.` → the trainer's after `layers.{i}.`
BLOCK_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
END_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Older checkpoints saved the rotary frequencies, which are derived, not learned.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UnsupportedCheckpoint(ConfigError):
    """The Hugging Face checkpoint asks for something the trainer's model does not compute."""


# --- names ----------------------------------------------------------------------------------


def trainer_name(hf_name: str) -> str | None:
    """The trainer's parameter for a Hugging Face tensor; None for one it cannot hold."""
    if hf_name in END_NAMES:
        return END_NAMES[hf_name]
    match = _BLOCK.fullmatch(hf_name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}"
    return None


def hf_name(name: str) -> str:
    """The Hugging Face name of one of the trainer's parameters."""
    for theirs, ours in END_NAMES.items():
        if name == ours:
            return theirs
    _, index, rest = name.split(".", 2)
    theirs = next(k for k, v in BLOCK_NAMES.items() if v == rest)
    return f"model.layers.{index}.{theirs}"


def trainer_names(shape: ModelShape) -> list[str]:
    """Every parameter of the whole model, in the model's order (the order files are cut in)."""
    blocks = [f"layers.{i}.{ours}" for i in range(shape.layers) for ours in BLOCK_NAMES.values()]
    return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]


# --- config.json ----------------------------------------------------------------------------


def shape_from_config(config: dict) -> tuple[ModelShape, bool]:
    """The trainer's shape for a Llama config.json, and whether its embeddings are tied."""

    def refuse(message: str):
        raise UnsupportedCheckpoint(f"config.json: {message}")

    if config.get("model_type") != "llama":
        refuse(f"model_type {config.get('model_type')!r}: only Llama models can be imported")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config['hidden_act']!r}: the trainer's feed-forward is SwiGLU")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            refuse(f"{flag}: the trainer's projections have no bias")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        refuse(f"head_dim {head_dim}: the trainer's is hidden_size / num_attention_heads")
    # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        refuse(f"rope type {kind!r}: the trainer implements plain rotary embeddings only")
    shape = ModelShape(
        layers=config["num_hidden_layers"],
        dim=dim,
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
    )
    problems = shape.problems()
    if problems:
        refuse("; ".join(problems))
    return shape, bool(config.get("tie_word_embeddings", False))


def config_from_shape(shape: ModelShape, dtype: torch.dtype) -> dict:
    """config.json for LlamaForCausalLM (the legacy rope keys, which every version reads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def differences(ours: ModelShape, theirs: ModelShape) -> list[str]:
    """Where the run's model and the checkpoint's differ (the length of sequences may)."""
    fields = (
        "layers",
        "dim",
        "heads",
        "kv_heads",
        "ffn_dim",
        "vocab_size",
        "norm_eps",
        "rope_theta",
    )
    return [
        f"{f} {getattr(ours, f)} ≠ {getattr(theirs, f)}"
        for f in fields
        if getattr(ours, f) != getattr(theirs, f)
    ]


# --- in -------------------------------------------------------------------------------------


class HFCheckpoint:
    """A Hugging Face Llama checkpoint directory, its tensors read one at a time by our names."""

    def __init__(self, directory: str | Path):
        if str(directory).startswith("s3://"):
            raise ConfigError(
                f"init.hf {directory}: the trainer reads a local directory; an S3 one is "
                "staged onto the node by the run plan (workers.trainer.stage) before it starts"
            )
        self.directory = Path(directory)
        try:
            config = json.loads((self.directory / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"init.hf: cannot read {self.directory / CONFIG}: {e}") from None
        self.shape, tied = shape_from_config(config)
        self._files = self._file_of_each_tensor()
        self._names: dict[str, str] = {}
        for theirs in self._files:
            ours = trainer_name(theirs)
            if ours is None:
                if theirs.endswith(DERIVED_SUFFIXES):
                    continue
                raise UnsupportedCheckpoint(f"{theirs}: the trainer's model has no such tensor")
            self._names[ours] = theirs
        if tied:
            self._names.setdefault("output.weight", "model.embed_tokens.weight")
        missing = [n for n in trainer_names(self.shape) if n not in self._names]
        if missing:
            raise ConfigError(f"init.hf: {self.directory} lacks {', '.join(map(hf_name, missing))}")
        self._open: dict[Path, object] = {}

    def _file_of_each_tensor(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / file for name, file in weight_map.items()}
        single = self.directory / SINGLE_FILE
        if not single.is_file():
            raise ConfigError(f"init.hf: {self.directory} has neither {SINGLE_FILE} nor {INDEX}")
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor for the trainer's parameter `name`, as stored (dtype included)."""
        from safetensors import safe_open

        theirs = self._names[name]
        file = self._files[theirs]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(theirs)


@torch.no_grad()
def load_into(parts: list[nn.Module], path: str, shape: ModelShape) -> None:
    """Copy a Hugging Face checkpoint into this rank's model parts (any layout, any stage).

    Call after the parts are materialised and initialised (the rotary tables are
    built there) and before DDP wraps them.
    """
    checkpoint = HFCheckpoint(path)
    wrong = differences(shape, checkpoint.shape)
    if wrong:
        raise ConfigError(
            f"init.hf {path} does not fit model ({'; '.join(wrong)}): give model.sizes "
            f"{json.dumps(sizes_of(checkpoint.shape))}"
        )
    count = 0
    for part in parts:
        for name, param in part.named_parameters():
            name = canonical_name(name)
            full = checkpoint.tensor(name)
            if tuple(full.shape) != tuple(param.shape):
                raise ConfigError(f"init.hf: {name} is {tuple(full.shape)}, not {param.shape}")
            fill(param, full.to(device=param.device, dtype=param.dtype))
            count += 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        metrics.emit(
            {
                "event": "init",
                "source": "hf",
                "path": str(path),
                "tensors": count,
                "time": time.time(),
            }
        )


def sizes_of(shape: ModelShape) -> dict:
    from dataclasses import asdict

    return asdict(shape)


# --- out ------------------------------------------------------------------------------------


def read_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors from a DCP checkpoint of any layout, in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(checkpoint))
    model = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith("model.")
    }
    state = {"model": model}
    with warnings.catch_warnings():  # that one process is meant, which it warns about
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {canonical_name(k): v for k, v in state["model"].items()}


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | Path | None = None,
) -> dict:
    """Write a committed trainer checkpoint as a Hugging Face Llama directory; what it wrote."""
    from safetensors.torch import save_file

    from workers.trainer.checkpoint import MANIFEST, file_problem

    checkpoint, out = Path(checkpoint), Path(out)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name, expected in manifest["files"].items():
        problem = file_problem(checkpoint, name, expected)
        if problem:
            raise ValueError(f"{checkpoint}: {problem}")
    shape = ModelShape(**manifest["model"]["shape"])
    state = read_model_state(checkpoint)
    names = trainer_names(shape)
    if sorted(state) != sorted(names):
        raise ValueError(f"{checkpoint}: its model tensors are not those of {shape}")

    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): state[n].to(dtype).contiguous() for n in names}
    shards = _cut(tensors, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers reads a file only with this mark
    if len(shards) == 1:
        files = [SINGLE_FILE]
        save_file(tensors, out / SINGLE_FILE, metadata=metadata)
    else:
        files = [SHARD.format(i, len(shards)) for i in range(1, len(shards) + 1)]
        for file, shard in zip(files, shards, strict=True):
            save_file({n: tensors[n] for n in shard}, out / file, metadata=metadata)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: f for f, shard in zip(files, shards, strict=True) for n in shard},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / CONFIG).write_text(json.dumps(config_from_shape(shape, dtype), indent=2))
    copied = _copy_tokenizer(tokenizer or trained_tokenizer(manifest), out)
    return {
        "event": "export",
        "step": manifest["step"],
        "checkpoint": str(checkpoint.resolve()),
        "path": str(out.resolve()),
        "files": [*files, *([INDEX] if len(files) > 1 else []), CONFIG, *copied],
        "bytes": sum((out / f).stat().st_size for f in files),
    }


def _cut(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of names, each under max_bytes unless one tensor alone is larger."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def trained_tokenizer(manifest: dict) -> Path | None:
    """The tokenizer.json the checkpoint's datasets were prepared with (their index names it
    and its SHA-256), when they all share one and it is still there unchanged; else None.
    Read with the rights of whoever exports (the agent runs the exporter as the job's user)."""
    from workers.trainer.checkpoint import sha256_of
    from workers.trainer.shards import read_index

    found = set()
    for dataset in (manifest.get("data") or {}).get("datasets") or []:
        try:
            tokenizer = read_index(dataset["path"])["tokenizer"]
            found.add((Path(dataset["path"]) / tokenizer["file"], tokenizer["sha256"]))
        except (KeyError, TypeError, ValueError):
            return None  # a token file, or a dataset gone: no tokenizer to speak for
    if len({sha for _, sha in found}) != 1:
        return None
    for path, sha in sorted(found):  # any copy still as prepared
        try:
            if path.is_file() and sha256_of(path) == sha:
                return path
        except OSError:
            continue
    return None


def _copy_tokenizer(source, out: Path) -> list[str]:
    """tokenizer.json (and its companions beside it) from a file or directory, if named."""
    if not source or not isinstance(source, str | Path):
        return []
    source = Path(source)
    directory = source if source.is_dir() else source.parent
    if not (directory / "tokenizer.json").is_file() and not source.is_file():
        raise ValueError(f"no tokenizer.json at {source}")
    copied = []
    if source.is_file():
        shutil.copyfile(source, out / "tokenizer.json")
        copied.append("tokenizer.json")
    for name in TOKENIZER_FILES:
        if name not in copied and (directory / name).is_file():
            shutil.copyfile(directory / name, out / name)
            copied.append(name)
    return copied


# --- command line ---------------------------------------------------------------------------


def byte_count(text: str) -> int:
    """500MB, 5GB, 2GiB or a plain number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered.removesuffix(unit)) * factor)
    return int(lowered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.trainer.hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("export", help="a committed checkpoint → a Hugging Face directory")
    out.add_argument("--checkpoint", required=True, help="a committed step-… directory")
    out.add_argument("--out", required=True, help="the directory to write")
    out.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    out.add_argument(
        "--max-shard-size",
        type=byte_count,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="cut model.safetensors into shards above this (e.g. 5GB)",
    )
    out.add_argument("--tokenizer", help="tokenizer.json (or its directory) to copy beside it")
    shape = commands.add_parser("shape", help="the model.sizes for run.json of an HF directory")
    shape.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            record = export(
                args.checkpoint,
                args.out,
                dtype=DTYPES[args.dtype],
                max_shard_bytes=args.max_shard_size,
                tokenizer=args.tokenizer,
            )
        else:
            record = {"sizes": sizes_of(HFCheckpoint(args.path).shape)}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
