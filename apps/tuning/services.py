"""Writes and rules for NCCL settings: profiles (ops), the environment a job gets on a pool's
nodes (its profile, then the job's overrides, linted), and the check job submission runs."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import F

from apps.accounts.selectors import roles_of
from apps.accounts.services import audited_create, audited_delete, audited_update
from apps.tuning import linter
from apps.tuning.catalogue import COVERED_PREFIXES, PARTLY_COVERED_PREFIXES
from apps.tuning.models import (
    ANY_FABRIC,
    NcclProfile,
    NcclProfileVersion,
    VersionSource,
    parse_version,
)
from apps.tuning.selectors import PoolNccl, default_profile, pools_nccl, profiles_all
from controlplane.errors import ApplicationError

PROFILE_FIELDS = {
    "name",
    "title",
    "description",
    "fabric",
    "single_node",
    "min_nccl_version",
    "max_nccl_version",
    "is_default",
    "env",
    "reasons",
}


def _require_ops(by) -> None:
    if by is not None and not roles_of(by).manages_fleet:
        raise ApplicationError("Only ops edit NCCL profiles.", code="permission_denied", status=403)


def explain(verdict: linter.Verdict, *, keep_with: str) -> str:
    """A verdict as one sentence for a 400: what is wrong, and how to fix or keep it."""
    if verdict.level == linter.ERROR:
        text = "; ".join(verdict.texts_at(linter.ERROR))
        if verdict.suggestions:
            text += f". Did you mean {' or '.join(verdict.suggestions)}?"
        return text[:1].upper() + text[1:] + ("" if text.endswith(("?", ".")) else ".")
    text = "; ".join(verdict.texts_at(linter.WARNING))
    return f"{text[:1].upper() + text[1:]}. Give {keep_with}.{verdict.name} to keep it."


def _reason_problems(env: Mapping, reasons: Mapping, *, prefix: str) -> dict[str, list[str]]:
    problems = {}
    for name, why in reasons.items():
        if name not in env:
            problems[f"{prefix}.{name}"] = [
                "A reason keeps a variable that is set; this one is not."
            ]
        elif not str(why).strip():
            problems[f"{prefix}.{name}"] = ["Say why it is kept."]
    return problems


# --- profiles ----------------------------------------------------------------------------


def _profile_problems(profile: NcclProfile, others: list[NcclProfile]) -> dict[str, list[str]]:
    problems = _reason_problems(profile.env or {}, profile.reasons or {}, prefix="reasons")
    for verdict in profile.lint():
        if verdict.blocking:
            problems.setdefault(f"env.{verdict.name}", []).append(
                explain(verdict, keep_with="reasons")
            )
    if profile.is_default:
        for other in others:
            if (
                other.pk != profile.pk
                and other.is_default
                and other.fabric == profile.fabric
                and other.single_node == profile.single_node
                and _ranges_overlap(profile, other)
            ):
                problems.setdefault("is_default", []).append(
                    f"{other.name} is already the default for these nodes and NCCL versions."
                )
    return problems


def _ranges_overlap(a: NcclProfile, b: NcclProfile) -> bool:
    top = (9999,)
    low = max(parse_version(a.min_nccl_version), parse_version(b.min_nccl_version))
    high = min(parse_version(a.max_nccl_version) or top, parse_version(b.max_nccl_version) or top)
    return low <= high


def _check_profile(profile: NcclProfile) -> None:
    problems = _profile_problems(profile, profiles_all())
    if problems:
        fields = ", ".join(problems)
        raise ApplicationError(f"The profile does not pass the linter: {fields}.", details=problems)


def _person(by):
    return by if by is not None and by.pk else None


def profile_version_add(
    profile: NcclProfile, *, by, source: str, note: str = "", tuning_run=None
) -> NcclProfileVersion:
    """Record the profile's environment as it now stands as its next version (the caller
    holds the profile's row)."""
    NcclProfile.objects.filter(pk=profile.pk).update(version=F("version") + 1)
    profile.refresh_from_db(fields=["version"])
    return NcclProfileVersion.objects.create(
        profile=profile,
        number=profile.version,
        env=profile.env,
        reasons=profile.reasons,
        source=source,
        note=note[:300],
        tuning_run=tuning_run,
        made_by=_person(by),
    )


@transaction.atomic
def nccl_profile_create(*, by, note: str = "", tuning_run=None, **fields) -> NcclProfile:
    """A new profile, and its version 1. `pool` (a tuning run's adoption) ties it to one pool."""
    _require_ops(by)
    pool = fields.pop("pool", None)
    unknown = set(fields) - PROFILE_FIELDS
    if unknown:
        raise ApplicationError(f"Unknown fields: {', '.join(sorted(unknown))}.")
    fields.setdefault("env", {})
    fields.setdefault("reasons", {})
    _check_profile(NcclProfile(**fields))
    fields["updated_by"] = _person(by)
    if pool is not None:
        fields["pool"] = pool
    profile = audited_create(model=NcclProfile, by=by, fields=fields, action="nccl_profile.create")
    source = VersionSource.ADOPTED if tuning_run is not None else VersionSource.CREATED
    profile_version_add(profile, by=by, source=source, note=note, tuning_run=tuning_run)
    return profile


@transaction.atomic
def nccl_profile_update(
    *,
    profile: NcclProfile,
    by,
    source: str = VersionSource.EDITED,
    note: str = "",
    tuning_run=None,
    **changes,
) -> NcclProfile:
    """Change a profile; a change of its environment or reasons is its next version."""
    _require_ops(by)
    if "name" in changes and changes["name"] != profile.name:
        raise ApplicationError(
            "A profile keeps its name: jobs refer to it by name.",
            details={"name": ["Create a new profile instead."]},
        )
    unknown = set(changes) - PROFILE_FIELDS
    if unknown:
        raise ApplicationError(f"Unknown fields: {', '.join(sorted(unknown))}.")
    draft = NcclProfile.objects.get(pk=profile.pk)
    for name, value in changes.items():
        setattr(draft, name, value)
    _check_profile(draft)
    changes["updated_by"] = _person(by)
    before = (
        NcclProfile.objects.select_for_update().values_list("env", "reasons").get(pk=profile.pk)
    )
    profile = audited_update(instance=profile, by=by, changes=changes, action="nccl_profile.update")
    if (profile.env, profile.reasons) != tuple(before):
        profile_version_add(profile, by=by, source=source, note=note, tuning_run=tuning_run)
    return profile


def nccl_profile_version_restore(*, version: NcclProfileVersion, by) -> NcclProfile:
    """Make an earlier version the profile's environment again, as its next version: one
    action, linted like any edit (a version the linter now refuses is not restored)."""
    _require_ops(by)
    profile = version.profile
    if version.number == profile.version:
        raise ApplicationError(
            f"Version {version.number} is {profile.name}'s current version.",
            code="invalid_transition",
            status=409,
        )
    return nccl_profile_update(
        profile=profile,
        by=by,
        env=version.env,
        reasons=version.reasons,
        source=VersionSource.RESTORED,
        note=f"version {version.number} restored",
    )


def nccl_profile_delete(*, profile: NcclProfile, by) -> None:
    _require_ops(by)
    if profile.built_in:
        raise ApplicationError(
            f"{profile.name} is built in: edit it instead.", code="protected", status=409
        )
    audited_delete(instance=profile, by=by, action="nccl_profile.delete")


# --- the environment a job gets on a pool's nodes ----------------------------------------------


@dataclass(frozen=True)
class RenderedVariable:
    name: str
    value: str
    source: str  # "profile" or "job"


@dataclass
class RenderedEnvironment:
    """What one pool's nodes would get for a job: the profile, then the job's overrides."""

    pool: PoolNccl
    profile: str  # the profile's name, or "" when none applies
    version: int = 0  # the profile's version number (NcclProfileVersion.number)
    variables: list[RenderedVariable] = field(default_factory=list)
    verdicts: list[linter.Verdict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # about the profile itself

    @property
    def env(self) -> dict[str, str]:
        return {v.name: v.value for v in self.variables}

    @property
    def ok(self) -> bool:
        return not self.problems and not any(v.blocking for v in self.verdicts)

    @property
    def file_text(self) -> str:
        return linter.render_env_file(self.env)

    def rows(self) -> list[tuple[RenderedVariable, linter.Verdict]]:
        return list(zip(self.variables, self.verdicts, strict=True))

    def as_dict(self) -> dict:
        return {
            "pool": self.pool.slug,
            "fabric": self.pool.fabric,
            "nccl_version": self.pool.nccl_version,
            "profile": self.profile or None,
            "profile_version": self.version or None,
            "ok": self.ok,
            "problems": self.problems,
            "variables": [
                {"name": var.name, "value": var.value, "source": var.source, **_verdict(ver)}
                for var, ver in self.rows()
            ],
        }


def _verdict(verdict: linter.Verdict) -> dict:
    return {
        "level": verdict.level,
        "reason": verdict.reason,
        "kept_because": verdict.kept_because,
    }


def _nccl_parts(nccl: Mapping | None) -> tuple[str, dict, dict]:
    nccl = nccl or {}
    return (
        nccl.get("profile") or "",
        dict(nccl.get("overrides") or {}),
        dict(nccl.get("reasons") or {}),
    )


def nccl_environment_render(
    *, nccl: Mapping | None, nodes: int, pool: PoolNccl, profiles: list[NcclProfile]
) -> RenderedEnvironment:
    """The environment a job's processes get on `pool`'s nodes, linted for those nodes."""
    name, overrides, job_reasons = _nccl_parts(nccl)
    single_node = nodes <= 1
    context = linter.Context(
        fabric=pool.fabric, nccl_version=pool.nccl_version, single_node=single_node
    )
    problems = []
    profile = None
    if name:
        profile = next((p for p in profiles if p.name == name), None)
        if profile is None:
            problems.append(f"No NCCL profile is named {name}.")
        elif profile.fabric != ANY_FABRIC and pool.fabric and profile.fabric != pool.fabric:
            problems.append(
                f"Profile {name} is for {profile.get_fabric_display()} nodes; pool "
                f"{pool.slug} is {pool.fabric}."
            )
        elif not profile.fits(pool.nccl_version):
            problems.append(
                f"Profile {name} is not for NCCL {pool.nccl_version} (pool {pool.slug})."
            )
    else:
        # A profile tuned for this very pool (a tuning run adopted it) comes first for jobs
        # across its nodes, which is what a tuning run measures.
        tuned = [p for p in profiles if p.pool_id == pool.pool_id] if not single_node else []
        profile = tuned[0] if tuned else None
        profile = profile or default_profile(
            profiles, fabric=pool.fabric, nccl_version=pool.nccl_version, single_node=single_node
        )
    variables = {
        key: RenderedVariable(key, value, "profile")
        for key, value in ((profile.env or {}) if profile else {}).items()
    }
    for key, value in overrides.items():
        variables[key] = RenderedVariable(key, value, "job")
    reasons = {
        key: why
        for key, why in ((profile.reasons or {}) if profile else {}).items()
        if key not in overrides
    }
    reasons.update(job_reasons)
    env = {key: var.value for key, var in variables.items()}
    return RenderedEnvironment(
        pool=pool,
        profile=profile.name if profile else "",
        version=profile.version if profile else 0,
        variables=list(variables.values()),
        verdicts=linter.lint(env, context=context, reasons=reasons),
        problems=problems,
    )


def nccl_environments_render(
    *, nccl: Mapping | None, nodes: int, pool_ids: list[int]
) -> list[RenderedEnvironment]:
    """One rendering per pool the job may run in (two queries, whatever the count)."""
    pools = pools_nccl(pool_ids=pool_ids)
    if not pools:
        return []
    profiles = profiles_all()
    return [
        nccl_environment_render(nccl=nccl, nodes=nodes, pool=pool, profiles=profiles)
        for pool in pools
    ]


def _in_scope(name: str) -> bool:
    return name.upper().startswith((*COVERED_PREFIXES, *PARTLY_COVERED_PREFIXES))


def nccl_spec_problems(
    *, nccl: Mapping | None, nodes: int, pool_ids: list[int]
) -> dict[str, list[str]]:
    """What is wrong with a job spec's `nccl` part, by field path (`nccl.overrides.NAME`).

    The overrides are linted on their own, then on top of the profile the job would get in
    each pool it may run in, for that pool's fabric and NCCL version: an override that
    breaks the job on any of them is refused now rather than when it bursts there. A
    warning (a debugging knob...) is kept only with `nccl.reasons.NAME`. No query runs for
    a spec without NCCL settings.
    """
    name, overrides, reasons = _nccl_parts(nccl)
    if not (name or overrides or reasons):
        return {}
    problems: dict[str, list[str]] = {}

    def add(path: str, message: str) -> None:
        if message not in problems.setdefault(path, []):
            problems[path].append(message)

    for path, messages in _reason_problems(overrides, reasons, prefix="nccl.reasons").items():
        for message in messages:
            add(path, message)
    profiles = profiles_all()
    if name and not any(p.name == name for p in profiles):
        known = ", ".join(p.name for p in profiles) or "none yet"
        add("nccl.profile", f"No NCCL profile is named {name} (profiles: {known}).")
    alone: dict[str, linter.Verdict] = {}
    for verdict in linter.lint(overrides, reasons=reasons):
        alone[verdict.name] = verdict
        if not _in_scope(verdict.name):
            add(
                f"nccl.overrides.{verdict.name}",
                "Not an NCCL, PyTorch-NCCL or EFA variable: put it in env.",
            )
        elif verdict.blocking:
            add(f"nccl.overrides.{verdict.name}", explain(verdict, keep_with="nccl.reasons"))
    for rendered in nccl_environments_render(nccl=nccl, nodes=nodes, pool_ids=pool_ids):
        pool = rendered.pool
        where = f"On pool {pool.slug} ({pool.fabric or 'fabric unknown'})"
        for problem in rendered.problems:
            if not problem.startswith("No NCCL profile"):
                add("nccl.profile", f"{problem} Leave nccl.profile out to get each pool's default.")
        for verdict in rendered.verdicts:
            if verdict.name not in overrides or verdict.level != linter.ERROR:
                continue
            seen = set(alone[verdict.name].texts_at(linter.ERROR))
            new = [text for text in verdict.texts_at(linter.ERROR) if text not in seen]
            if new:
                add(f"nccl.overrides.{verdict.name}", f"{where}: {'; '.join(new)}.")
    return problems
