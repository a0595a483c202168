"""Candidate NCCL settings for a tuning run: the pool's baseline plus one change (or a few
sensible pairs), of variables the catalogue knows, each passed by the linter for the fabric.

Pure functions, no Django. The variables a tuning run varies are mostly ones NCCL's user
guide lists under "Debugging" (NCCL_ALGO, NCCL_PROTO, the channel counts, NCCL_BUFFSIZE,
NCCL_IB_QPS_PER_CONNECTION, NCCL_NET_GDR_LEVEL): the linter warns that they are not meant to
stay set unmeasured, and a tuning run is that measurement, so this warning, and only this one,
is kept with a reason (MEASURED). Any error, and any other warning (a variable with no effect
on the fabric; one aws-ofi-nccl sets itself on EFA), drops the candidate.

What the linter refuses shapes the list: NCCL_PROTO naming LL128 forces it on (it can corrupt
data where unsupported), so LL128 is reached as "^LL" (LL128 and Simple, NCCL choosing);
on EFA any NCCL_PROTO that cuts LL or LL128 is refused, as are NCCL_BUFFSIZE and
NCCL_MIN_NCHANNELS (the plugin sets them), which leaves NCCL_ALGO, NCCL_MAX_NCHANNELS,
NCCL_NET_GDR_LEVEL and libfabric's FI_EFA_USE_DEVICE_RDMA there.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from apps.tuning import catalogue as c
from apps.tuning import linter

DEFAULT_LIMIT = 12
MEASURED = "chosen by a tuning run's measurement, kept only if it is faster beyond the noise"
GENERATED, OPS = "generated", "ops"

# (changes) in the order they are tried: the cap keeps the first ones, so the variables that
# most often matter come first, one value each, then their second values, then the pairs.
_EVERYWHERE = (
    {"NCCL_ALGO": "Ring"},
    {"NCCL_ALGO": "Tree"},
    {"NCCL_PROTO": "Simple"},
    {"NCCL_PROTO": "^LL"},
    {"NCCL_MAX_NCHANNELS": "16"},
    {"NCCL_MIN_NCHANNELS": "16"},
    {"NCCL_BUFFSIZE": "8388608"},
    {"NCCL_BUFFSIZE": "16777216"},
)
_IB = (
    {"NCCL_IB_QPS_PER_CONNECTION": "2"},
    {"NCCL_IB_QPS_PER_CONNECTION": "4"},
    {"NCCL_NET_GDR_LEVEL": "PHB"},
    {"NCCL_NET_GDR_LEVEL": "SYS"},
    {"NCCL_IB_QPS_PER_CONNECTION": "4", "NCCL_IB_SPLIT_DATA_ON_QPS": "1"},
    {"NCCL_MIN_NCHANNELS": "32", "NCCL_MAX_NCHANNELS": "32"},
)
_EFA = (
    {"FI_EFA_USE_DEVICE_RDMA": "1"},
    {"NCCL_NET_GDR_LEVEL": "SYS"},
)
_TCP = (
    {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
    {"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "2"},
)
VARIATIONS = {
    c.INFINIBAND: (*_EVERYWHERE, *_IB),
    c.ROCE: (*_EVERYWHERE, *_IB),
    c.EFA: (*_EVERYWHERE, *_EFA),
    c.TCP: (*_EVERYWHERE, *_TCP),
}


class CandidateRefused(ValueError):
    """An ops-given candidate the linter refuses; `name` and `reason` are the linter's."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class Candidate:
    label: str  # "NCCL_ALGO=Tree", or the pairs joined with ", "
    changes: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]  # the whole environment: the baseline with the changes
    origin: str = GENERATED

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class Dropped:
    label: str
    name: str
    reason: str


def _tolerated(text: str, name: str) -> bool:
    """The Debugging warning of a catalogued debugging variable: what a measurement answers."""
    var = c.VARIABLES.get(name)
    return bool(var and var.debugging) and text.endswith("not meant to stay set in production")


def problems(
    changes: Mapping[str, str], *, baseline: Mapping[str, str], context: linter.Context
) -> list[tuple[str, str]]:
    """(name, reason) for each thing that keeps `changes` over `baseline` from being measured:
    an error anywhere in the environment, or a warning on a changed variable other than the
    Debugging one, or a warning the change brings to a baseline variable."""
    env = {**baseline, **changes}
    before = {
        v.name: set(v.texts_at(linter.WARNING)) for v in linter.lint(baseline, context=context)
    }
    out = []
    for verdict in linter.lint(env, context=context):
        name = verdict.name
        for text in verdict.texts_at(linter.ERROR):
            out.append((name, text))
        for text in verdict.texts_at(linter.WARNING):
            new = text not in before.get(name, set())
            if (name in changes and not _tolerated(text, name)) or (name not in changes and new):
                out.append((name, text))
    return out


def _candidate(changes: Mapping[str, str], baseline: Mapping[str, str], origin: str) -> Candidate:
    label = ", ".join(f"{k}={v}" for k, v in changes.items())
    env = {**baseline, **changes}
    return Candidate(label, tuple(changes.items()), tuple(env.items()), origin)


def _newer_name(name: str, context: linter.Context) -> str:
    """The channel counts' successors (NCCL_MIN_CTAS, …) where the nodes' NCCL reads them."""
    var = c.VARIABLES[name]
    successor = c.VARIABLES.get(var.superseded_by) if var.superseded_by else None
    version = context.version
    if successor and successor.since and version and c.version_at_least(version, successor.since):
        return successor.name
    return name


def generate(
    *,
    baseline: Mapping[str, str],
    context: linter.Context,
    limit: int = DEFAULT_LIMIT,
) -> tuple[list[Candidate], list[Dropped]]:
    """Candidates for the fabric of `context`, at most `limit`, and those the linter dropped.
    A variation the baseline already has is no candidate."""
    kept: list[Candidate] = []
    dropped: list[Dropped] = []
    seen = set()
    for variation in VARIATIONS.get(context.fabric, _EVERYWHERE):
        changes = {_newer_name(k, context): v for k, v in variation.items()}
        key = tuple(sorted(changes.items()))
        if key in seen or all(baseline.get(k) == v for k, v in changes.items()):
            continue
        seen.add(key)
        # A successor inherits what the linter says against the older name (on EFA the
        # plugin's advice names NCCL_MIN_NCHANNELS, and it means the successor as much).
        found = problems(changes, baseline=baseline, context=context) or problems(
            variation, baseline=baseline, context=context
        )
        candidate = _candidate(changes, baseline, GENERATED)
        if found:
            dropped.extend(Dropped(candidate.label, name, reason) for name, reason in found)
        elif len(kept) < limit:
            kept.append(candidate)
    return kept, dropped


def with_ops_candidates(
    extra: Iterable[Mapping[str, str]],
    *,
    baseline: Mapping[str, str],
    context: linter.Context,
    limit: int = DEFAULT_LIMIT,
) -> list[Candidate]:
    """Ops' own candidates (each: changes over the baseline) first, then generated ones up to
    `limit` in all. Raises CandidateRefused, with the linter's reason, at the first bad one."""
    own = []
    for changes in extra:
        changes = dict(changes)
        if not changes:
            raise CandidateRefused("(empty)", "a candidate must change at least one variable")
        for name in changes:
            if not linter.NAME_RE.match(name):
                raise CandidateRefused(name, "not an environment variable name")
        found = problems(changes, baseline=baseline, context=context)
        if found:
            raise CandidateRefused(*found[0])
        own.append(_candidate(changes, baseline, OPS))
    generated, _ = generate(baseline=baseline, context=context, limit=max(limit - len(own), 0))
    labels = {o.label for o in own}
    return own + [g for g in generated if g.label not in labels]
