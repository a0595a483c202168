"""A rendezvous port something else holds on the head node, end to end: real agents refuse
rank 0 with the reason, the job is requeued (the node's fault, not the job's) instead of
waiting on a store that is not its own, and its next attempt takes another port."""

import socket

import pytest

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import wait_for
from tests.e2e.test_command_jobs import _log_texts, _run_to_the_end, _submit

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _held_port_with_a_free_neighbour() -> tuple[socket.socket, int]:
    """A port this machine's stray process listens on, whose next port is free."""
    for _ in range(50):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with socket.socket() as neighbour:
            try:
                neighbour.bind(("127.0.0.1", port + 1))
            except OSError:
                held.close()
                continue
        return held, port
    raise AssertionError("no two neighbouring ports free")


def test_a_busy_rendezvous_port_requeues_the_job_onto_another_port(
    local_nodes, e2e_team, api_for, settings
):
    pool = factories.make_owned_pool(slug="e2e-rdzv")
    local_nodes(pool, count=2, gpus=1)
    admin = factories.make_member(team=e2e_team, role="admin")
    api = api_for(admin, scopes=("submit",))
    held, port = _held_port_with_a_free_neighbour()
    try:
        settings.RENDEZVOUS_PORT_BASE, settings.RENDEZVOUS_PORT_SPREAD = port, 1
        code = "import os; print('rendezvous on', os.environ['MASTER_PORT'])"
        job = _submit(
            api,
            e2e_team,
            ["python3", "-c", code],
            resources={"nodes": 2, "gpus_per_node": 1},
        )
        scheduling_pass()
        job_dispatch(job_id=job.pk)
        requeued = wait_for(
            "the job to be requeued",
            lambda: (j := Job.objects.get(pk=job.pk)).state != "starting" and j,
            timeout_s=60,
        )
        assert requeued.state == "pending", requeued.state_reason
        assert requeued.restarts == 1
        assert requeued.state_reason.endswith(
            f"could not start: rendezvous port {port} is busy on this node (infrastructure)"
        )
        refused = Run.objects.get(job=job, attempt=1, node_rank=0)
        assert (refused.state, refused.node_fault) == ("refused", "rendezvous_port_busy")
        assert refused.pid is None  # nothing of the job ran on the head node

        settings.RENDEZVOUS_PORT_SPREAD = 2  # the busy port, and one beside it
        finished = _run_to_the_end(requeued)
    finally:
        held.close()
    assert finished.state == "succeeded", finished.state_reason
    assert Run.objects.get(job=job, attempt=2, node_rank=0).rendezvous_port == port + 1
    wait_for(  # the agents relay output a moment after the exit
        "both ranks' output",
        lambda: _log_texts(api, job).count(f"rendezvous on {port + 1}") == 2,
        timeout_s=20,
    )
