"""The pieces every provider shares: command quoting, env files, the bundle, nvidia-smi's output."""

import shlex
import subprocess

import pytest

from workers.providers.bundle import Bundle, bundle_files, env_file_text
from workers.providers.errors import ConfigurationError, HostKeyUnknown, ProviderError
from workers.providers.gpus import gpu_report, parse_gpus
from workers.providers.shell import quote_argv


def test_quote_argv_round_trips_through_a_real_shell():
    argv = ["printf", "%s|", "; rm -rf /", "$(id)", "it's", "", "a b", "\n"]

    line = quote_argv(argv)

    assert shlex.split(line) == argv
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert out == "; rm -rf /|$(id)|it's||a b|\n|"


@pytest.mark.parametrize("bad", ["ls -l", b"ls", [], ["ls", 3], ["echo", "a\0b"]])
def test_quote_argv_refuses_anything_but_a_list_of_strings(bad):
    with pytest.raises(ConfigurationError):
        quote_argv(bad)


def test_env_files_refuse_a_value_that_would_add_a_line():
    assert env_file_text({"A": "1", "B_2": "x=y z"}) == "A=1\nB_2=x=y z\n"
    with pytest.raises(ConfigurationError):
        env_file_text({"A": "1\nEVIL=1"})
    with pytest.raises(ConfigurationError):
        env_file_text({"NOT A NAME": "1"})
    with pytest.raises(ConfigurationError):
        Bundle(agent_argv=("agent",), agent_env={"TOKEN": "a\rb"})


def test_the_bundle_holds_the_packages_without_caches(tmp_path):
    package = tmp_path / "agent"
    (package / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text("print()")
    (package / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\0")

    files = dict(bundle_files(Bundle(agent_argv=("agent",), packages=(package,))))

    assert set(files) == {
        "workers/__init__.py",
        "workers/agent/__init__.py",
        "workers/agent/main.py",
    }
    with pytest.raises(ConfigurationError):
        Bundle(agent_argv=("agent",), packages=(tmp_path,))  # not a package


def test_nvidia_smi_lines_are_read_into_gpus():
    text = (
        "0, GPU-11111111-2222-3333-4444-555555555555, NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n"
        "1, GPU-66666666-7777-8888-9999-000000000000, NVIDIA H100 80GB HBM3, [N/A], 550.54.15\n"
        "\n"
    )

    first, second = parse_gpus(text)

    assert first.index == 0 and first.memory_mib == 81559 and first.driver_version == "550.54.15"
    assert second.memory_mib is None


@pytest.mark.parametrize(
    ("status", "stdout", "found", "says"),
    [
        (127, "", False, "not on the node's PATH"),
        (9, "NVIDIA-SMI has failed: no driver", False, "status 9"),
        (0, "", False, "listed no GPUs"),
        (0, "0, GPU-1, H100\n", False, "cannot read"),
        (0, "0, GPU-1, NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n", True, "1 GPUs"),
    ],
)
def test_every_outcome_of_nvidia_smi_is_a_report_not_an_exception(status, stdout, found, says):
    report = gpu_report(status, stdout, "")

    assert report.found is found
    assert says in report.message


def test_errors_say_whether_to_retry():
    assert ProviderError("x").retryable is False
    assert ProviderError("x", retryable=True).retryable is True
    unknown = HostKeyUnknown(
        host="10.0.0.5", port=22, key_type="ssh-ed25519", key_base64="AAAA", fingerprint="SHA256:x"
    )
    assert unknown.offered_key == "ssh-ed25519 AAAA"
    assert unknown.retryable is False
