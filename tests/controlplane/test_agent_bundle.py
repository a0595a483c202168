"""The agent bundle cloud nodes download at first boot: code only, runnable where unpacked."""

import io
import shutil
import subprocess
import sys
import tarfile

import pytest
from django.urls import reverse

from controlplane.agent_bundle import bundle_archive
from workers.providers.aws import AGENT_BUNDLE_PATH
from workers.providers.bundle import AGENT_PACKAGE, TRAINER_PACKAGE


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {member.name: member for member in tar.getmembers()}


def test_the_bundle_is_served_where_the_user_data_fetches_it():
    assert reverse("agent-bundle") == AGENT_BUNDLE_PATH


@pytest.mark.django_db
def test_anyone_downloads_the_agent_and_trainer_and_no_settings(client):
    response = client.get(AGENT_BUNDLE_PATH)  # curl in user data has no credentials

    assert response.status_code == 200
    assert response["Content-Type"] == "application/gzip"
    data = b"".join(response.streaming_content)
    assert int(response["Content-Length"]) == len(data)
    names = members(data)
    assert {
        "workers/__init__.py",
        "workers/agent/__main__.py",
        "workers/trainer/presets.py",
    } <= set(names)
    assert all(
        name.startswith(("workers/agent/", "workers/trainer/")) or name == "workers/__init__.py"
        for name in names
    )
    assert not [name for name in names if name.endswith(("agent.env", ".pyc")) or "/." in name]
    assert all(member.isfile() and member.mode == 0o644 for member in names.values())


@pytest.mark.django_db
def test_an_unchanged_bundle_is_not_sent_again(client):
    first = client.get(AGENT_BUNDLE_PATH)
    again = client.get(AGENT_BUNDLE_PATH, HTTP_IF_NONE_MATCH=first["ETag"])
    assert again.status_code == 304
    assert client.post(AGENT_BUNDLE_PATH).status_code == 405


def test_settings_a_developers_agent_left_in_the_packages_are_not_shipped(tmp_path):
    agent = tmp_path / "agent"
    shutil.copytree(AGENT_PACKAGE, agent, ignore=shutil.ignore_patterns("__pycache__"))
    (agent / "agent.env").write_text("CONTROLPLANE_NODE_TOKEN=cpn_secret\n")
    (agent / "nccl.env").write_text("NCCL_DEBUG=INFO\n")
    (agent / "agent.log").write_text("token cpn_secret\n")
    (agent / ".netrc").write_text("machine x password y\n")

    data, digest = bundle_archive([agent, TRAINER_PACKAGE])

    names = members(data)
    assert "workers/agent/__main__.py" in names
    assert not [n for n in names if n.endswith(("agent.env", "nccl.env", "agent.log", ".netrc"))]
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert not any(b"cpn_secret" in tar.extractfile(m).read() for m in tar.getmembers())
    # The same files give the same bytes (an ETag that holds across processes).
    assert bundle_archive([agent, TRAINER_PACKAGE]) == (data, digest)


def test_the_unpacked_bundle_runs_the_agent_without_the_repository(tmp_path):
    data, _ = bundle_archive()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        # Our own archive; the "data" filter where this Python has it (3.11.4 and later).
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, **safe)  # noqa: S202 (the bundle we just built)

    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import workers.agent.config, workers.agent; print(workers.agent.__file__)",
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert found.stdout.strip() == str(tmp_path / "workers" / "agent" / "__init__.py")
