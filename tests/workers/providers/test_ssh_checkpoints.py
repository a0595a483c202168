"""Checkpoints on an owned node reached over SSH (a real sshd on 127.0.0.1): its agent, copied
and started by the SSH provider, checks a checkpoint on its own disk against the manifest,
catches a damaged file, and deletes the directory when GC asks, through the live server."""

from pathlib import Path

import pytest

from apps.accounts import services as accounts
from apps.checkpoints import services
from apps.checkpoints.api.reports import checkpoint_report_parse
from apps.checkpoints.models import Checkpoint
from apps.fleet import services as fleet
from apps.fleet.models import Node
from apps.jobs import services as jobs
from apps.jobs.models import Run
from tests import factories
from tests.apps.checkpoints.conftest import commit_event, write_checkpoint
from tests.apps.jobs.conftest import trainer_spec
from tests.e2e.conftest import wait_for
from tests.workers.providers.servers import ssh_keygen_fingerprint
from tests.workers.providers.test_ssh_provisioning import _ssh_node, owned_host  # noqa: F401
from workers.tasks.provisioning import provision_node, terminate_node

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_an_ssh_nodes_agent_checks_and_deletes_its_own_checkpoints(
    owned_host,  # noqa: F811
    settings,
    tmp_path,
):
    settings.CHECKPOINT_ROOT = str(tmp_path / "node-disk")
    settings.CHECKPOINT_ROOT_SHARED = False  # the owned node's own disk
    node = _ssh_node(owned_host)
    provision_node(node.pk)
    fleet.node_host_key_accept(
        node=Node.objects.get(pk=node.pk),
        fingerprint=ssh_keygen_fingerprint(owned_host.host_key),
        by=None,
    )
    try:
        provision_node(node.pk)
        wait_for("the agent to register", lambda: Node.objects.get(pk=node.pk).state == "ready")
        team = factories.make_team(slug="ssh-ckpt")
        accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
        spec = trainer_spec(
            team, preset="tiny", nodes=1, gpus_per_node=4, layout={"dp_shard": 4}, seq_len=256
        )
        job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=None)
        # A run the agent reports on (started elsewhere: the sshd's host has no torch).
        run = Run.objects.create(
            job=job, node_id=node.pk, attempt=1, node_rank=0, plan={"argv": ["x"]}, state="running"
        )
        from apps.jobs.runconfig import checkpoint_dir

        path, digest = write_checkpoint(Path(checkpoint_dir(job)), 10, job=job)
        services.checkpoint_event_record(
            run=run, report=checkpoint_report_parse(commit_event(path, digest, 10))
        )
        checkpoint = Checkpoint.objects.get(job=job)
        assert checkpoint.copies.get().kind == "node_local"
        wait_for(
            "the SSH node's agent to verify it",
            lambda: Checkpoint.objects.get(pk=checkpoint.pk).state == "verified",
            timeout_s=30,
        )

        (path / ".metadata").write_bytes(b"bit rot")
        services.checkpoint_verify_request(checkpoint=checkpoint, by=None)
        wait_for(
            "the damage to be caught",
            lambda: Checkpoint.objects.get(pk=checkpoint.pk).state == "corrupt",
            timeout_s=30,
        )
        assert ".metadata has 7 bytes" in checkpoint.copies.get().error

        services.checkpoint_delete(checkpoint=checkpoint, by=None, reason="GC")
        assert path.exists()  # storage first
        wait_for(
            "the agent to delete it",
            lambda: Checkpoint.objects.get(pk=checkpoint.pk).state == "deleted",
            timeout_s=30,
        )
        assert not path.exists()
    finally:
        terminate_node(node.pk)
