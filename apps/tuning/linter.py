"""The NCCL environment linter: pure functions of the catalogue, no Django.

`parse_text` reads environment blocks as people paste them (`export NAME=value`,
`NAME=value`, Python's `os.environ["NAME"] = "value"`); `lint` gives one verdict per
variable (`error`, `warning` or `ok`, with the reasons), knowing the fabric and NCCL
version of the nodes when it is told them. Profiles and jobs may keep a warning only
with a reason (`reasons[NAME]`); an error is never kept.
"""

import difflib
import ipaddress
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from apps.tuning import catalogue as c

OK, WARNING, ERROR = "ok", "warning", "error"
_RANK = {OK: 0, WARNING: 1, ERROR: 2}

# \Z, not $: "$" also matches before a final newline.
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SHELL_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_PYTHON_LINE = re.compile(
    r"""^\s*os\.environ\[\s*(['"])([A-Za-z_][A-Za-z0-9_]*)\1\s*\]\s*=\s*"""
    r"""(?:(['"])(.*?)\3)\s*(?:\#.*)?$"""
)
_INTEGER = re.compile(r"^[+-]?(?:\d+|0[xX][0-9a-fA-F]+)\Z")


@dataclass(frozen=True)
class Context:
    """What the linter knows of the nodes the environment is for."""

    fabric: str = ""  # one of catalogue.FABRICS, or "" when unknown
    nccl_version: str = ""  # "2.21.5", or "" when unknown
    single_node: bool = False

    @property
    def version(self) -> tuple[int, ...]:
        try:
            return c.version_tuple(self.nccl_version)
        except ValueError:
            return ()


@dataclass(frozen=True)
class Verdict:
    level: str  # the worst of its findings
    name: str
    value: str
    findings: tuple[tuple[str, str], ...]  # (level, text), worst first
    suggestions: tuple[str, ...] = ()
    kept_because: str = ""  # the reason a profile or job gave for keeping a warning

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(text for _, text in self.findings)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def texts_at(self, level: str) -> tuple[str, ...]:
        return tuple(text for lvl, text in self.findings if lvl == level)

    @property
    def blocking(self) -> bool:
        """Refused in a profile or a job: an error, or a warning nobody gave a reason for."""
        return self.level == ERROR or (self.level == WARNING and not self.kept_because)

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "name": self.name,
            "value": self.value,
            "reason": self.reason,
            "suggestions": list(self.suggestions),
            "kept_because": self.kept_because,
        }


@dataclass(frozen=True)
class Assignment:
    name: str
    value: str
    line: int


@dataclass
class Parsed:
    assignments: list[Assignment] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # numbers of non-blank lines that set nothing

    @property
    def ignored_lines(self) -> int:
        return len(self.skipped)

    def environment(self) -> dict[str, str]:
        """Name → value, the last assignment of a name winning (as in a shell)."""
        return {a.name: a.value for a in self.assignments}

    def repeated(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for a in self.assignments:
            counts[a.name] = counts.get(a.name, 0) + 1
        return {name: n for name, n in counts.items() if n > 1}


# --- reading pasted text ------------------------------------------------------------------


def _shell_value(raw: str) -> str | None:
    """The value of `NAME=raw` as a POSIX shell would assign it, or None if it is no plain
    assignment (an unquoted space would make the rest a command: prose, not a setting)."""
    if not raw.strip():
        return ""
    try:
        words = shlex.split(raw, comments=True)
    except ValueError:
        return None
    if raw[:1].isspace():  # `NAME= value` assigns "" and runs `value`
        return None
    if len(words) != 1:
        return "" if not words else None
    return words[0]


def _looks_like_setting(name: str) -> bool:
    """Environment names are upper case; `device_id=local_rank,` in pasted code is not one.
    A lower-case NCCL or torch name is kept, so the linter can say what is wrong with it."""
    return name == name.upper() or name.upper().startswith(c.COVERED_PREFIXES)


def parse_text(text: str) -> Parsed:
    """Every assignment in `text`; other lines (prose, code, comments) are counted and skipped."""
    parsed = Parsed()
    for number, line in enumerate(text.splitlines(), start=1):
        python = _PYTHON_LINE.match(line)
        if python:
            parsed.assignments.append(Assignment(python.group(2), python.group(4), number))
            continue
        shell = _SHELL_LINE.match(line)
        if shell and _looks_like_setting(shell.group(1)):
            value = _shell_value(shell.group(2))
            if value is not None:
                parsed.assignments.append(Assignment(shell.group(1), value, number))
                continue
        if line.strip():
            parsed.skipped.append(number)
    return parsed


def render_env_file(env: Mapping[str, str]) -> str:
    """The environment as `export NAME='value'` lines, safe to source from a shell."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())


# --- suggestions -------------------------------------------------------------------------


def suggestions_for(name: str) -> tuple[str, ...]:
    """Catalogue names someone writing `name` probably meant, best first."""
    upper = name.upper()
    hinted = list(c.INVENTED.get(upper, ("", ()))[1])
    if upper != name and upper in c.VARIABLES:
        hinted.insert(0, upper)
    close = difflib.get_close_matches(upper, c.known_names(), n=3, cutoff=0.75)
    out = []
    for candidate in [*hinted, *close]:
        if candidate in c.VARIABLES and candidate not in out and candidate != name:
            out.append(candidate)
    return tuple(out[:3])


# --- values ------------------------------------------------------------------------------


def _int(text: str) -> int | None:
    text = text.strip()
    if not _INTEGER.match(text):
        return None
    return int(text, 0) if text.lower().lstrip("+-").startswith("0x") else int(text, 10)


def _check_range(var: c.Variable, number: int, findings: list) -> None:
    low, high = var.minimum, var.maximum
    if (low is not None and number < low) or (high is not None and number > high):
        span = f"{low if low is not None else '…'}..{high if high is not None else '…'}"
        findings.append(
            (ERROR, f"{number} is outside {span}" + (f": {var.note}" if var.note else ""))
        )


def _check_list(
    value: str, *, names: tuple[str, ...], what: str, findings: list, case_sensitive=False
) -> list[str]:
    body = value[1:] if value.startswith("^") else value
    tokens = [t.strip() for t in body.split(",")]
    known = names if case_sensitive else tuple(n.lower() for n in names)
    bad = [t for t in tokens if (t if case_sensitive else t.lower()) not in known]
    if bad:
        findings.append(
            (ERROR, f"{', '.join(repr(b) for b in bad)}: not {what} ({', '.join(names)})")
        )
    return tokens


def _check_selection(var: c.Variable, value: str, context: Context, findings: list) -> dict:
    """NCCL_ALGO / NCCL_PROTO: `[^]a,b` or (2.24+) `a,b;func:[^]c,d`. Returns what is
    allowed per function ("*" for the default entry) as (excluding, names) pairs."""
    is_algo = var.kind == c.ALGORITHMS
    names = tuple(c.ALGORITHM_VERSIONS) if is_algo else c.PROTOCOL_NAMES
    what = "an NCCL algorithm" if is_algo else "an NCCL protocol"
    entries = [e.strip() for e in value.split(";")]
    selections: dict[str, tuple[bool, list[str]]] = {}
    version = context.version
    per_function = len(entries) > 1 or ":" in value
    if per_function and version and not c.version_at_least(version, c.PER_FUNCTION_SINCE):
        findings.append((ERROR, f"per-function lists need NCCL {c.PER_FUNCTION_SINCE} or newer"))
    for index, entry in enumerate(entries):
        if not entry:
            findings.append((ERROR, "an empty entry between semicolons"))
            continue
        function = "*"
        if ":" in entry:
            function, entry = (part.strip() for part in entry.split(":", 1))
            if function.lower() not in c.FUNCTION_NAMES:
                findings.append(
                    (ERROR, f"{function!r} is not a collective ({', '.join(c.FUNCTION_NAMES)})")
                )
            function = function.lower()
        elif index:
            findings.append((ERROR, "only the first entry may leave out the function name"))
        tokens = _check_list(entry, names=names, what=what, findings=findings)
        lowered = [t.lower() for t in tokens]
        if is_algo and version:
            for token in lowered:
                first, last = c.ALGORITHM_VERSIONS.get(token, ("", ""))
                if first and not c.version_at_least(version, first):
                    findings.append((ERROR, f"{token} needs NCCL {first} or newer"))
                if last and c.version_at_least(version, _next_minor(last)):
                    findings.append((ERROR, f"{token} was replaced after NCCL {last}"))
        selections[function] = (entry.startswith("^"), lowered)
    return selections


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def _check_value(var: c.Variable, value: str, context: Context, findings: list) -> None:
    kind = var.kind
    text = value.strip()
    if value == "" and not var.allow_empty:
        findings.append((WARNING, "empty: it is read as unset"))
        return
    if kind in (c.INT, c.BYTES):
        number = _int(text)
        if number is None:
            findings.append((ERROR, f"{value!r} is not an integer"))
            return
        if kind == c.BYTES and number < 1:
            findings.append((ERROR, "a size in bytes must be at least 1"))
        _check_range(var, number, findings)
        old_nccl = context.version and not c.version_at_least(context.version, "2.25")
        if var.name in ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS") and number > 32 and old_nccl:
            findings.append((ERROR, "above 32 needs NCCL 2.25 or newer"))
        if kind == c.BYTES and number > 0 and number & (number - 1):
            findings.append((OK, "not a power of two, which NCCL recommends"))
    elif kind == c.BOOL:
        if text not in ("0", "1"):
            findings.append((ERROR, f"{value!r}: use 0 or 1"))
    elif kind == c.TORCH_BOOL:
        if text.lower() not in ("0", "1", "true", "false", "yes", "no", "y", "n", "t", "f"):
            findings.append((ERROR, f"{value!r}: use 1 or 0"))
    elif kind == c.CHOICE:
        given = text if var.case_sensitive else text.upper()
        allowed = var.choices if var.case_sensitive else tuple(x.upper() for x in var.choices)
        if given not in allowed:
            findings.append((ERROR, f"{value!r}: one of {', '.join(var.choices)}"))
            if var.name == "NCCL_DEBUG":
                findings.append((ERROR, "NCCL reads an unknown level as 'log nothing'"))
        elif var.name == "NCCL_DEBUG" and given in ("INFO", "TRACE"):
            findings.append((OK, "verbose: fine while diagnosing; WARN is the usual level"))
        elif var.name == "NCCL_LAUNCH_MODE" and given == "GROUP":
            findings.append((WARNING, "GROUP is deprecated since NCCL 2.9"))
    elif kind == c.LEVEL:
        _check_level(var, text, findings)
    elif kind in (c.ALGORITHMS, c.PROTOCOLS):
        _check_selection(var, text, context, findings)
    elif kind == c.SUBSYSTEMS:
        _check_list(text, names=c.DEBUG_SUBSYSTEMS, what="a subsystem", findings=findings)
    elif kind == c.LOG_LEVELS:
        if text:
            _check_list(text, names=c.TIMESTAMP_LEVELS, what="a log level", findings=findings)
    elif kind in (c.INTERFACES, c.HCAS):
        body = text.lstrip("^").lstrip("=")
        tokens = [t.strip() for t in body.split(",")]
        if not body or any(not t or " " in t for t in tokens):
            findings.append((ERROR, f"{value!r}: a comma-separated list of names"))
        elif kind == c.HCAS and any(not re.match(r"^[\w.-]+(:\d+)?\Z", t) for t in tokens):
            findings.append((ERROR, f"{value!r}: device names, each with an optional :port"))
    elif kind == c.NETDEVS:
        if not re.match(r"^(AUTO|ALL|MAX:[1-9]\d*)\Z", text):
            findings.append((ERROR, f"{value!r}: AUTO, ALL or MAX:n"))
    elif kind == c.CIDR:
        try:
            ipaddress.ip_network(text, strict=False)
        except ValueError:
            findings.append((ERROR, f"{value!r} is not an address range (CIDR)"))
    elif kind == c.HOST_PORT:
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            findings.append((ERROR, f"{value!r}: host:port"))
    elif kind == c.PATH:
        if "~" in text:
            findings.append((ERROR, "NCCL does not expand '~'; give an absolute path"))
    elif kind == c.NETWORK:
        _check_network(text, context, findings)


def _check_level(var: c.Variable, text: str, findings: list) -> None:
    if text in var.choices:
        return
    if text.upper() in var.choices:
        findings.append(
            (
                ERROR,
                f"{text!r}: NCCL compares level names case-sensitively and would ignore "
                f"it; write {text.upper()}",
            )
        )
        return
    number = _int(text)
    if number is not None and number >= 0 and text[:1].isdigit():
        name = c.LEGACY_LEVELS[min(number, len(c.LEGACY_LEVELS) - 1)]
        findings.append((WARNING, f"legacy number (means {name}); write {name}"))
        return
    findings.append((ERROR, f"{text!r}: one of {', '.join(var.choices)}"))


def _check_network(text: str, context: Context, findings: list) -> None:
    lowered = text.lower()
    if lowered not in c.BUILTIN_NETS and lowered not in c.LIBFABRIC_NETS:
        findings.append(
            (
                WARNING,
                f"{text!r} is neither NCCL's IB or Socket nor aws-ofi-nccl; NCCL fails at init "
                "unless a plugin has that name",
            )
        )
        return
    expected = c.NETS_FOR_FABRIC.get(context.fabric)
    if expected and lowered not in expected:
        findings.append(
            (ERROR, f"{text} is not the network of {context.fabric} nodes: NCCL would fail")
        )


# --- one variable, then the combinations ----------------------------------------------------


def _covered(name: str) -> bool:
    return name.upper().startswith(c.COVERED_PREFIXES)


def _partly_covered(name: str) -> bool:
    return name.upper().startswith(c.PARTLY_COVERED_PREFIXES)


def _is_true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "y", "t")


def _lint_known(var: c.Variable, value: str, context: Context) -> list:
    findings: list = []
    version = context.version
    if var.renamed_to:
        when = f" ({var.note.rstrip('.')})" if var.note else ""
        findings.append(
            (
                ERROR,
                f"renamed to {var.renamed_to}{when}: use the new name, as with both set "
                "one silently wins",
            )
        )
    elif var.removed_in:
        replacement = f"; use {var.superseded_by}" if var.superseded_by else ""
        findings.append((ERROR, f"removed in NCCL {var.removed_in}, it does nothing{replacement}"))
    if not var.current:
        return findings
    if (
        var.family == "nccl"
        and var.since
        and version
        and not c.version_at_least(version, var.since)
    ):
        findings.append(
            (ERROR, f"NCCL {context.nccl_version} does not read it (added in {var.since})")
        )
    _check_value(var, value, context, findings)
    if var.fabrics and context.fabric and context.fabric not in var.fabrics:
        findings.append((WARNING, f"no effect on {context.fabric} nodes"))
    if var.debugging:
        where = (
            "listed under Debugging in NCCL's user guide"
            if var.family == "nccl"
            else "a debugging aid"
        )
        findings.append((WARNING, f"{where}: not meant to stay set in production"))
    if not var.documented:
        findings.append((WARNING, f"undocumented ({c.SOURCES[var.source]}): it may change"))
    if var.discouraged:
        level = ERROR if var.name == "RDMAV_FORK_SAFE" and context.fabric == c.EFA else WARNING
        findings.append((level, var.discouraged))
    if var.superseded_by and not var.removed_in:
        findings.append((OK, f"superseded by {var.superseded_by}"))
    if var.default is not None and value.strip().upper() == var.default.upper():
        if var.debugging:
            findings.append((WARNING, f"same as the default ({var.default}): remove it"))
        else:
            findings.append((OK, f"same as the default ({var.default})"))
    return findings


def _lint_unknown(name: str, context: Context) -> tuple[list, tuple[str, ...]]:
    hints = suggestions_for(name)
    invented = c.INVENTED.get(name.upper())
    if name != name.upper() and name.upper() in c.VARIABLES:
        return [(ERROR, f"names are case-sensitive: the variable is {name.upper()}")], hints
    if _covered(name):
        family = "PyTorch" if name.upper().startswith("TORCH_") else "NCCL"
        message = f"not an {family} variable (no release reads it)"
        if invented:
            message += f": {invented[0]}"
        return [(ERROR, message)], hints
    if name.startswith("RDMAV_") and context.fabric == c.EFA:
        return [(ERROR, "aws-ofi-nccl's notes say not to use RDMAV_* variables with EFA")], hints
    if _partly_covered(name):
        return [(WARNING, "not in the catalogue (libfabric/EFA); not checked")], hints
    return [(OK, "not an NCCL, PyTorch-NCCL or EFA variable; not checked")], ()


def _combinations(env: Mapping[str, str], context: Context) -> dict[str, list]:
    """Findings that come from several variables together, or from the fabric."""
    found: dict[str, list] = {}

    def add(name: str, level: str, text: str) -> None:
        found.setdefault(name, []).append((level, text))

    fabric = context.fabric
    ib_off = _is_true(env.get("NCCL_IB_DISABLE", "0"))
    if ib_off and fabric in c.IB_VERBS:
        add(
            "NCCL_IB_DISABLE",
            ERROR,
            f"these nodes talk over {fabric}: disabling IB sends everything over TCP sockets",
        )
    proto = env.get("NCCL_PROTO")
    if proto is not None:
        selections = _check_selection(c.VARIABLES["NCCL_PROTO"], proto.strip(), context, [])
        for excluding, tokens in selections.values():
            if not excluding and "ll128" in tokens:
                add(
                    "NCCL_PROTO",
                    ERROR,
                    "names LL128, which forces it on: on platforms without LL128 support "
                    "that can corrupt data (NCCL user guide); NCCL enables it by itself "
                    "where it is safe",
                )
                break
        if fabric == c.EFA:
            cut = set()
            for excluding, tokens in selections.values():
                if excluding:
                    cut |= {p for p in ("ll", "ll128") if p in tokens}
                else:
                    cut |= {p for p in ("ll", "ll128") if p not in tokens}
            if cut:
                add(
                    "NCCL_PROTO",
                    ERROR,
                    f"switches off {' and '.join(sorted(p.upper() for p in cut))} on EFA (p5): "
                    "aws-ofi-nccl 1.7+ falls back to Simple by itself only when EFA cannot "
                    "keep writes in order; NCCL_PROTO=simple was advice for plugin ≤ 1.5",
                )
    threads, sockets = env.get("NCCL_SOCKET_NTHREADS"), env.get("NCCL_NSOCKS_PERTHREAD")
    if threads is not None and sockets is not None:
        t, s = _int(threads), _int(sockets)
        if t is not None and s is not None and t * s > 64:
            for name in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
                add(name, ERROR, f"NCCL_SOCKET_NTHREADS × NCCL_NSOCKS_PERTHREAD = {t * s} > 64")
    if fabric == c.EFA:
        for name in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
            if name in env:
                add(name, WARNING, "not applicable to EFA (aws-ofi-nccl's notes)")
        for name in ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_P2P_NET_CHUNKSIZE"):
            if name in env:
                add(name, WARNING, "on p5 aws-ofi-nccl sets or advises this itself; leave it out")
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" in env and _is_true(env["TORCH_NCCL_DUMP_ON_TIMEOUT"]):
        # Under either of the buffer's names, the new one first (as torch reads them).
        buffer = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
        size = _int(buffer) or 0
        if size <= 0:
            add(
                "TORCH_NCCL_DUMP_ON_TIMEOUT",
                WARNING,
                "dumps nothing unless TORCH_FR_BUFFER_SIZE > 0 is set with it "
                "(TORCH_NCCL_TRACE_BUFFER_SIZE > 0 for torches from before the rename)",
            )
    ar, buffsize = env.get("NCCL_IB_AR_THRESHOLD"), env.get("NCCL_BUFFSIZE")
    if ar is not None:
        threshold, size = _int(ar), _int(buffsize) if buffsize is not None else 4194304
        if threshold is not None and size is not None and threshold > size:
            add("NCCL_IB_AR_THRESHOLD", OK, "above NCCL_BUFFSIZE: adaptive routing is off")
    for old in ("NCCL_MAX_NRINGS", "NCCL_MIN_NRINGS"):
        new = c.VARIABLES[old].renamed_to
        if old in env and new in env:
            add(old, ERROR, f"ignored: {new} is set as well")
    return found


def lint(
    env: Mapping[str, str],
    *,
    context: Context | None = None,
    reasons: Mapping[str, str] | None = None,
) -> list[Verdict]:
    """One verdict per variable, in the order given."""
    context = context or Context()
    reasons = reasons or {}
    combined = _combinations(env, context)
    verdicts = []
    for name, value in env.items():
        var = c.VARIABLES.get(name)
        hints: tuple[str, ...] = ()
        if var is None:
            findings, hints = _lint_unknown(name, context)
        else:
            findings = _lint_known(var, value, context)
            replacement = var.superseded_by if var.removed_in else ""
            hints = tuple(h for h in (var.renamed_to, replacement) if h)
        findings.extend(combined.get(name, []))
        if any(ch in value for ch in "\n\r\x00"):
            findings.append((ERROR, "the value must be one line of text"))
        if not findings and var is not None:
            findings = [(OK, var.summary)]
        ordered = tuple(sorted(findings, key=lambda f: -_RANK[f[0]]))
        level = ordered[0][0] if ordered else OK
        reason = (reasons.get(name) or "").strip()
        verdicts.append(
            Verdict(
                level=level,
                name=name,
                value=value,
                findings=ordered,
                suggestions=hints,
                kept_because=reason if level == WARNING else "",
            )
        )
    return verdicts


def lint_text(text: str, *, context: Context | None = None) -> tuple[list[Verdict], Parsed]:
    """Parse a pasted block and lint it; a name assigned twice is noted on its verdict."""
    parsed = parse_text(text)
    verdicts = lint(parsed.environment(), context=context)
    repeated = parsed.repeated()
    if repeated:
        verdicts = [
            Verdict(
                level=v.level,
                name=v.name,
                value=v.value,
                findings=(*v.findings, (OK, f"set {repeated[v.name]} times; the last wins")),
                suggestions=v.suggestions,
            )
            if v.name in repeated
            else v
            for v in verdicts
        ]
    return verdicts, parsed


def counts(verdicts: list[Verdict]) -> dict[str, int]:
    out = {ERROR: 0, WARNING: 0, OK: 0}
    for v in verdicts:
        out[v.level] += 1
    return out


def format_verdict(verdict: Verdict) -> str:
    """One line for a terminal: level, name, the reason, and what to use instead."""
    line = f"{verdict.level:<7} {verdict.name}  {verdict.reason}"
    if verdict.suggestions and verdict.name not in c.VARIABLES:
        line += f" (did you mean {' or '.join(verdict.suggestions)}?)"
    if verdict.kept_because:
        line += f" [kept: {verdict.kept_because}]"
    return line
