"""The command-line linters: `manage.py nccl_lint FILE` and `cpctl nccl-lint FILE`."""

import io
import os
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command

from apps.accounts import services as accounts

BLOG = """\
# We also had to increase the NCCL ring buffer size to avoid timeouts:
export NCCL_IB_TIMEOUT=60
export NCCL_NET=IB
export NCCL_IB_DISABLE_DIRECT=1
"""
CLEAN = 'export NCCL_DEBUG=WARN\nos.environ["NCCL_IB_TIMEOUT"] = "22"\n'


def lint(path, *options) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("nccl_lint", str(path), *options, stdout=out, stderr=err)
    except SystemExit as exit_:
        return exit_.code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def test_one_verdict_per_variable_and_exit_1_on_errors(tmp_path):
    block = tmp_path / "nccl.env"
    block.write_text(BLOG)
    code, out, err = lint(block)
    assert code == 1
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["error", "NCCL_IB_TIMEOUT"],
        ["ok", "NCCL_NET"],
        ["error", "NCCL_IB_DISABLE_DIRECT"],
    ]
    assert "60 is outside 1..31" in lines[0]
    assert lines[2].endswith("(did you mean NCCL_IB_DISABLE or NCCL_P2P_DIRECT_DISABLE?)")
    assert "2 error(s), 0 warning(s), 1 ok; 1 other line(s) skipped" in err


def test_warnings_alone_exit_0_and_the_fabric_counts(tmp_path):
    block = tmp_path / "nccl.env"
    block.write_text("export NCCL_PROTO=Simple\n")
    code, out, _ = lint(block)
    assert code == 0 and out.startswith("warning NCCL_PROTO")
    code, out, _ = lint(block, "--fabric", "efa", "--nccl-version", "2.21.5")
    assert code == 1 and "on EFA" in out


def test_a_clean_block_exits_0(tmp_path):
    block = tmp_path / "nccl.py"
    block.write_text(CLEAN)
    code, out, _ = lint(block)
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["ok", "ok"]


def test_bad_usage_is_exit_2(tmp_path):
    with pytest.raises(CommandError) as missing:
        lint(tmp_path / "nope.env")
    assert missing.value.returncode == 2
    block = tmp_path / "nccl.env"
    block.write_text(CLEAN)
    with pytest.raises(CommandError) as version:
        lint(block, "--nccl-version", "two")
    assert version.value.returncode == 2


def cpctl(live_server, token, *args):
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "cpctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_cpctl_nccl_lint_against_the_live_server(live_server, viewer, tmp_path):
    _, token = accounts.api_token_create(user=viewer, name="ci", scopes=["read"], by=viewer)
    blog, clean = tmp_path / "blog.env", tmp_path / "clean.env"
    blog.write_text(BLOG)
    clean.write_text(CLEAN)

    failed = cpctl(live_server, token, "nccl-lint", str(blog), "--fabric", "infiniband")
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout.splitlines()[0].startswith("error   NCCL_IB_TIMEOUT  60 is outside 1..31")
    assert "did you mean NCCL_IB_DISABLE or NCCL_P2P_DIRECT_DISABLE?" in failed.stdout
    assert "2 error(s), 0 warning(s), 1 ok" in failed.stderr

    passed = cpctl(live_server, token, "nccl-lint", str(clean))
    assert passed.returncode == 0 and passed.stdout.count("ok ") == 2

    as_json = cpctl(live_server, token, "-o", "json", "nccl-lint", str(blog))
    assert as_json.returncode == 1 and '"counts"' in as_json.stdout

    missing = cpctl(live_server, token, "nccl-lint", str(tmp_path / "nope.env"))
    assert missing.returncode == 2
