"""The linter as a pure function: one table row per rule, then properties over the catalogue."""

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.tuning import catalogue as c
from apps.tuning import linter
from apps.tuning.linter import ERROR, OK, WARNING, Context

IB = Context(fabric=c.INFINIBAND, nccl_version="2.26.2")
EFA = Context(fabric=c.EFA, nccl_version="2.26.2")
OLD_NCCL = Context(nccl_version="2.21.5")


def verdict_of(name, value, context=None, **others):
    env = {**others, name: value}
    return next(v for v in linter.lint(env, context=context) if v.name == name)


RULES = [
    # (name, value, context, other variables, expected level, a phrase of the reason)
    # unknown names: errors, with what was probably meant
    ("NCCL_IB_DISABLE_CUDA_VGRAPH", "1", None, {}, ERROR, "not an NCCL variable"),
    ("NCCL_TIMEOUT", "600", None, {}, ERROR, "init_process_group(timeout=...)"),
    ("TORCH_NCCL_MADE_UP", "1", None, {}, ERROR, "not an PyTorch variable"),
    ("nccl_debug", "WARN", None, {}, ERROR, "the variable is NCCL_DEBUG"),
    # removed and renamed names say what replaced them
    ("NCCL_IB_CUDA_SUPPORT", "1", None, {}, ERROR, "use NCCL_NET_GDR_LEVEL"),
    ("NCCL_LL_THRESHOLD", "0", None, {}, ERROR, "removed in NCCL 2.5"),
    ("NCCL_IB_GDR_LEVEL", "PHB", None, {}, ERROR, "renamed to NCCL_NET_GDR_LEVEL"),
    ("NCCL_ASYNC_ERROR_HANDLING", "1", None, {}, ERROR, "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("NCCL_BLOCKING_WAIT", "1", None, {}, ERROR, "renamed to TORCH_NCCL_BLOCKING_WAIT"),
    ("NCCL_DESYNC_DEBUG", "1", None, {}, ERROR, "torch 2.2.0"),
    # values outside the allowed set or range
    ("NCCL_IB_TIMEOUT", "60", None, {}, ERROR, "outside 1..31"),
    ("NCCL_IB_TIMEOUT", "0", None, {}, ERROR, "no timeout at all"),
    ("NCCL_IB_TIMEOUT", "22", None, {}, OK, "4.096 µs"),
    ("NCCL_IB_TIMEOUT", "twenty", None, {}, ERROR, "not an integer"),
    ("NCCL_IB_RETRY_CNT", "8", None, {}, ERROR, "outside 0..7"),
    ("NCCL_CROSS_NIC", "3", None, {}, ERROR, "one of 0, 1, 2"),
    ("NCCL_DEBUG", "WARN", None, {}, OK, "NCCL logs"),
    ("NCCL_DEBUG", "warn", None, {}, OK, "NCCL logs"),
    ("NCCL_DEBUG", "VERBOSE", None, {}, ERROR, "'log nothing'"),
    ("NCCL_LAUNCH_MODE", "PARALLEL", None, {}, WARNING, "same as the default"),
    ("NCCL_LAUNCH_MODE", "GROUP", None, {}, WARNING, "deprecated since NCCL 2.9"),
    ("NCCL_LAUNCH_MODE", "FAST", None, {}, ERROR, "one of PARALLEL, GROUP"),
    ("NCCL_PROTO", "Simple", None, {}, WARNING, "Debugging"),
    ("NCCL_PROTO", "^LL128", None, {}, WARNING, "Debugging"),
    ("NCCL_PROTO", "LL,Fast", None, {}, ERROR, "not an NCCL protocol"),
    ("NCCL_ALGO", "Tree", None, {}, WARNING, "Debugging"),
    ("NCCL_ALGO", "ring,collnetdirect;allreduce:tree", None, {}, WARNING, "Debugging"),
    ("NCCL_ALGO", "allreduce:^tree", OLD_NCCL, {}, ERROR, "per-function lists need NCCL 2.24"),
    ("NCCL_ALGO", "PAT", OLD_NCCL, {}, ERROR, "pat needs NCCL 2.23"),
    ("NCCL_ALGO", "collnet", IB, {}, ERROR, "replaced after NCCL 2.13"),
    (
        "NCCL_ALGO",
        "allgather:ring;alltoall:ring",
        None,
        {},
        ERROR,
        "'alltoall' is not a collective",
    ),
    ("NCCL_NET_GDR_LEVEL", "PHB", None, {}, WARNING, "Debugging"),
    ("NCCL_NET_GDR_LEVEL", "phb", None, {}, ERROR, "case-sensitively"),
    ("NCCL_NET_GDR_LEVEL", "3", None, {}, WARNING, "legacy number (means PHB)"),
    ("NCCL_NET_GDR_LEVEL", "NVL", None, {}, ERROR, "one of LOC, PIX, PXB, PHB, SYS"),
    ("NCCL_P2P_LEVEL", "NVL", None, {}, WARNING, "Debugging"),
    ("NCCL_NTHREADS", "1024", None, {}, ERROR, "one of 64, 128, 256, 512"),
    ("NCCL_BUFFSIZE", "0", None, {}, ERROR, "at least 1"),
    ("NCCL_BUFFSIZE", "3000000", None, {}, WARNING, "not a power of two"),
    ("NCCL_MIN_NCHANNELS", "33", None, {}, ERROR, "outside 1..32"),
    ("NCCL_MIN_NCHANNELS", "16", None, {}, WARNING, "superseded by NCCL_MIN_CTAS"),
    ("NCCL_MAX_CTAS", "48", OLD_NCCL, {}, ERROR, "above 32 needs NCCL 2.25"),
    ("NCCL_SOCKET_IFNAME", "=eth0,eth1", None, {}, OK, "IP interfaces"),
    ("NCCL_SOCKET_IFNAME", "eth0 eth1", None, {}, ERROR, "comma-separated"),
    ("NCCL_IB_HCA", "=mlx5_0:1,mlx5_1:1", None, {}, OK, "RDMA devices"),
    ("NCCL_IB_HCA", "mlx5_0;mlx5_1", None, {}, ERROR, "device names"),
    ("NCCL_IB_ADDR_RANGE", "10.0.0.0/8", None, {}, OK, "CIDR"),
    ("NCCL_IB_ADDR_RANGE", "10.0.0/8x", None, {}, ERROR, "not an address range"),
    ("NCCL_DEBUG_FILE", "~/nccl.%h.%p", None, {}, ERROR, "does not expand '~'"),
    ("NCCL_NETDEVS_POLICY", "MAX:2", None, {}, OK, "network devices"),
    ("NCCL_NETDEVS_POLICY", "SOME", None, {}, ERROR, "AUTO, ALL or MAX:n"),
    ("NCCL_RAS_ADDR", "localhost", None, {}, ERROR, "host:port"),
    ("NCCL_DEBUG_SUBSYS", "INIT,NET,FOO", None, {}, ERROR, "'FOO': not a subsystem"),
    ("NCCL_DEBUG_TIMESTAMP_FORMAT", "", None, {}, OK, "strftime"),
    ("NCCL_SOCKET_IFNAME", "", None, {}, WARNING, "read as unset"),
    # version awareness: a variable newer than the nodes' NCCL does nothing there
    ("NCCL_IB_RETURN_ASYNC_EVENTS", "1", OLD_NCCL, {}, ERROR, "added in 2.23"),
    ("NCCL_IB_RETURN_ASYNC_EVENTS", "1", IB, {}, OK, "same as the default"),
    # debugging knobs are warnings; undocumented and not-advised settings too
    ("NCCL_P2P_DISABLE", "0", None, {}, WARNING, "remove it"),
    ("NCCL_CHUNK_SIZE", "524288", None, {}, WARNING, "undocumented"),
    ("FI_EFA_FORK_SAFE", "1", EFA, {}, WARNING, "aws-ofi-nccl sets it itself"),
    ("FI_EFA_SOMETHING_NEW", "1", EFA, {}, WARNING, "not checked"),
    ("RDMAV_FORK_SAFE", "1", EFA, {}, ERROR, "RDMAV_FORK_SAFE=1 can break things"),
    ("RDMAV_HUGEPAGES_SAFE", "1", EFA, {}, ERROR, "not to use RDMAV_*"),
    ("CUDA_VISIBLE_DEVICES", "0,1", None, {}, OK, "not checked"),
    ("TORCH_NCCL_DESYNC_DEBUG", "1", None, {}, WARNING, "debugging aid"),
    ("TORCH_NCCL_BLOCKING_WAIT", "true", None, {}, OK, "wait()"),
    ("TORCH_NCCL_BLOCKING_WAIT", "maybe", None, {}, ERROR, "use 1 or 0"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", None, {}, OK, "same as the default"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "4", None, {}, ERROR, "one of 0, 1, 2, 3"),
    # known-bad combinations: the fabric, and variables together
    ("NCCL_IB_DISABLE", "1", IB, {}, ERROR, "disabling IB sends everything over TCP"),
    ("NCCL_IB_DISABLE", "1", Context(fabric=c.TCP), {}, WARNING, "Debugging"),
    ("NCCL_NET", "IB", IB, {}, OK, "Forces one network"),
    ("NCCL_NET", "IB", EFA, {}, ERROR, "not the network of efa nodes"),
    ("NCCL_NET", "Socket", IB, {}, ERROR, "not the network of infiniband nodes"),
    ("NCCL_NET", "AWS Libfabric", EFA, {}, OK, "Forces one network"),
    ("NCCL_NET", "MyPlugin", None, {}, WARNING, "unless a plugin has that name"),
    ("NCCL_PROTO", "Simple", EFA, {}, ERROR, "switches off LL and LL128 on EFA"),
    ("NCCL_PROTO", "^LL128", EFA, {}, ERROR, "switches off LL128 on EFA"),
    ("NCCL_PROTO", "^LL128", IB, {}, WARNING, "Debugging"),
    ("NCCL_PROTO", "LL,LL128,Simple", None, {}, ERROR, "can corrupt data"),
    ("NCCL_PROTO", "allreduce:LL128", None, {}, ERROR, "forces it on"),
    ("NCCL_IB_HCA", "=mlx5_0", EFA, {}, WARNING, "no effect on efa nodes"),
    ("NCCL_SOCKET_NTHREADS", "16", None, {"NCCL_NSOCKS_PERTHREAD": "8"}, ERROR, "128 > 64"),
    ("NCCL_SOCKET_NTHREADS", "4", None, {"NCCL_NSOCKS_PERTHREAD": "4"}, OK, "helper threads"),
    ("NCCL_BUFFSIZE", "8388608", EFA, {}, WARNING, "aws-ofi-nccl sets or advises this"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", None, {}, WARNING, "TORCH_FR_BUFFER_SIZE > 0"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", None, {"TORCH_FR_BUFFER_SIZE": "2000"}, OK, "flight"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", None, {"TORCH_FR_BUFFER_SIZE": "0"}, WARNING, "nothing"),
    # torch renamed the flight recorder's variables (torch 2.13 warns about the old names)
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", None, {}, OK, "superseded by TORCH_FR_BUFFER_SIZE"),
    ("TORCH_NCCL_TRACE_CPP_STACK", "1", None, {}, OK, "superseded by TORCH_FR_CPP_STACK"),
    ("TORCH_FR_BUFFER_SIZE", "2000", None, {}, OK, "ring buffer"),
    ("TORCH_FR_BUFFER_SIZE", "-1", None, {}, ERROR, "-1 is outside 0.."),
    ("TORCH_FR_CPP_STACK", "maybe", None, {}, ERROR, "use 1 or 0"),
    ("TORCH_FR_SOMETHING_NEW", "1", None, {}, OK, "not checked"),
    (
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "1",
        None,
        {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"},
        OK,
        "flight recorder",
    ),
    (
        "NCCL_MIN_NRINGS",
        "4",
        None,
        {"NCCL_MIN_NCHANNELS": "8"},
        ERROR,
        "ignored: NCCL_MIN_NCHANNELS",
    ),
]


@pytest.mark.parametrize(
    ("name", "value", "context", "others", "level", "phrase"),
    RULES,
    ids=[
        f"{r[0]}={r[1]}" + (f"@{r[2].fabric or r[2].nccl_version}" if r[2] else "") for r in RULES
    ],
)
def test_each_rule(name, value, context, others, level, phrase):
    verdict = verdict_of(name, value, context, **others)
    assert verdict.level == level, verdict.reason
    assert phrase in verdict.reason


def test_unknown_names_suggest_what_was_meant():
    assert verdict_of("NCCL_IB_DISABLE_CUDA_VGRAPH", "1").suggestions == (
        "NCCL_NET_GDR_LEVEL",
        "NCCL_IB_DISABLE",
    )
    assert verdict_of("NCCL_MIN_CHANNELS", "8").suggestions[0] == "NCCL_MIN_NCHANNELS"
    assert verdict_of("NCCL_IB_TIMOUT", "20").suggestions[0] == "NCCL_IB_TIMEOUT"
    assert verdict_of("NCCL_ASYNC_ERROR_HANDLING", "1").suggestions == (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    )


def test_a_reason_keeps_a_warning_but_never_an_error():
    kept = linter.lint(
        {"NCCL_ALGO": "Ring", "NCCL_IB_TIMEOUT": "99"},
        reasons={"NCCL_ALGO": "Tree hangs on 2.21 here", "NCCL_IB_TIMEOUT": "please"},
    )
    algo, timeout = kept
    assert (algo.level, algo.kept_because, algo.blocking) == (
        WARNING,
        "Tree hangs on 2.21 here",
        False,
    )
    assert (timeout.level, timeout.kept_because, timeout.blocking) == (ERROR, "", True)


def test_one_verdict_per_variable_in_order_with_the_worst_finding_first():
    env = {"NCCL_PROTO": "Simple", "NCCL_DEBUG": "INFO", "NCCL_MADE_UP": "1"}
    verdicts = linter.lint(env, context=EFA)
    assert [v.name for v in verdicts] == list(env)
    proto = verdicts[0]
    assert proto.findings[0][0] == ERROR and proto.findings[-1][0] == WARNING


# --- reading pasted text --------------------------------------------------------------------

PASTE = """\
# a comment
export NCCL_DEBUG=WARN
NCCL_SOCKET_IFNAME==eth0   # trailing comment
export NCCL_NET="AWS Libfabric"
export NCCL_IB_HCA='=mlx5_0,mlx5_1'
os.environ["NCCL_ALGO"] = "Tree"
os.environ['NCCL_BUFFSIZE'] = '268435456'  # 256MB
Fix: set NCCL_DEBUG=INFO when it hangs
NCCL_DEBUG=WARNto see which rank is slow.
device_id=local_rank,
    export NCCL_IB_TIMEOUT=22
"""


def test_parse_reads_shell_and_python_lines_and_skips_prose_and_code():
    parsed = linter.parse_text(PASTE)
    assert parsed.environment() == {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "=eth0",
        "NCCL_NET": "AWS Libfabric",
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
        "NCCL_ALGO": "Tree",
        "NCCL_BUFFSIZE": "268435456",
        "NCCL_IB_TIMEOUT": "22",
    }
    assert parsed.skipped == [1, 8, 9, 10]


def test_a_name_set_twice_keeps_the_last_value_and_says_so():
    verdicts, _ = linter.lint_text("NCCL_DEBUG=INFO\nNCCL_DEBUG=WARN\n")
    (debug,) = verdicts
    assert debug.value == "WARN" and "set 2 times; the last wins" in debug.reason


def test_format_verdict_is_one_line_with_the_suggestion():
    line = linter.format_verdict(verdict_of("NCCL_IB_DISABLE_DIRECT", "1"))
    assert line.startswith("error   NCCL_IB_DISABLE_DIRECT  not an NCCL variable")
    assert line.endswith("(did you mean NCCL_IB_DISABLE or NCCL_P2P_DIRECT_DISABLE?)")
    assert "\n" not in line


# --- properties -------------------------------------------------------------------------------

CURRENT = [v for v in c.VARIABLES.values() if v.current]
PLAIN_WITH_DEFAULTS = [
    v
    for v in CURRENT
    if v.default is not None and not (v.debugging or v.discouraged or not v.documented)
]


@pytest.mark.parametrize("var", [v for v in CURRENT if v.default is not None], ids=lambda v: v.name)
def test_every_default_is_a_valid_value(var):
    verdict = verdict_of(var.name, var.default)
    assert verdict.level != ERROR, verdict.reason


@pytest.mark.parametrize("var", PLAIN_WITH_DEFAULTS, ids=lambda v: v.name)
def test_the_default_of_a_system_setting_lints_ok(var):
    verdict = verdict_of(var.name, var.default)
    assert verdict.level == OK, verdict.reason


@pytest.mark.parametrize("var", [v for v in CURRENT if v.debugging], ids=lambda v: v.name)
def test_every_debugging_knob_is_at_least_a_warning(var):
    value = var.default if var.default is not None else (var.choices or ("1",))[0]
    assert verdict_of(var.name, value).level in (WARNING, ERROR)


@pytest.mark.parametrize(
    "var", [v for v in c.VARIABLES.values() if not v.current], ids=lambda v: v.name
)
def test_removed_and_renamed_variables_are_errors_naming_the_replacement(var):
    verdict = verdict_of(var.name, var.default or "1")
    assert verdict.level == ERROR
    replacement = var.renamed_to or var.superseded_by
    if replacement:
        assert replacement in verdict.reason and replacement in verdict.suggestions


_SUFFIX = st.text(alphabet=string.ascii_uppercase + string.digits + "_", min_size=1, max_size=24)


@given(prefix=st.sampled_from(c.COVERED_PREFIXES), suffix=_SUFFIX, value=st.text(max_size=30))
def test_any_unknown_name_under_nccl_or_torch_nccl_is_an_error(prefix, suffix, value):
    name = prefix + suffix
    if name in c.VARIABLES:
        return
    (verdict,) = linter.lint({name: value})
    assert verdict.level == ERROR
    assert all(s in c.VARIABLES for s in verdict.suggestions)


@given(
    env=st.dictionaries(
        st.one_of(
            st.sampled_from(sorted(c.VARIABLES)),
            st.from_regex(r"[A-Z_][A-Z0-9_]{0,20}", fullmatch=True),
        ),
        st.text(max_size=40),
        max_size=8,
    ),
    fabric=st.sampled_from(["", *c.FABRICS]),
    version=st.sampled_from(["", "2.18", "2.21.5", "2.28.6"]),
)
def test_lint_never_fails_and_answers_every_variable(env, fabric, version):
    verdicts = linter.lint(env, context=Context(fabric=fabric, nccl_version=version))
    assert [v.name for v in verdicts] == list(env)
    assert all(v.level in (OK, WARNING, ERROR) and v.reason for v in verdicts)


@given(st.text(max_size=400))
def test_parsing_any_text_never_fails(text):
    parsed = linter.parse_text(text)
    assert len(parsed.assignments) + len(parsed.skipped) <= len(text.splitlines())


@given(
    st.dictionaries(
        st.from_regex(r"[A-Z_][A-Z0-9_]{0,20}", fullmatch=True),
        st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40),
        max_size=6,
    )
)
def test_the_environment_file_reads_back_as_the_same_variables(env):
    assert linter.parse_text(linter.render_env_file(env)).environment() == env
