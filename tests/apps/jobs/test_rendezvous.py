"""Rendezvous ports: each attempt's rank-0 run holds a port of its head node's address that
no other open run holds, given back when the run ends; a port an agent finds busy requeues
the job (the node's fault, not the job's) and is not handed out again at once."""

import threading

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from apps.accounts import services as accounts
from apps.jobs import services as jobs
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import Job, NodeFault, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import command_spec, trainer_spec

BASE = 29500


@pytest.fixture
def ports(settings):
    """`ports(n)`: the rendezvous range is the n ports from BASE."""

    def narrow(spread: int) -> None:
        settings.RENDEZVOUS_PORT_BASE = BASE
        settings.RENDEZVOUS_PORT_SPREAD = spread

    narrow(1000)
    return narrow


@pytest.fixture
def quota(team):
    return accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)


def _nodes(count: int, *, addresses=None) -> list:
    pool = factories.make_owned_pool(slug=factories.unique("rdzv"))
    addresses = addresses or [""] * count
    return [ready_node(pool=pool, gpu_count=8, address=address) for address in addresses]


def _submit(team, user, *, gpus: int = 1, **overrides) -> Job:
    spec = command_spec(team, resources={"gpu_type": "H100", "gpus": gpus}, **overrides)
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=user)
    return job


def _placed_and_dispatched(job_list: list[Job]) -> list[Job]:
    scheduling_pass()
    for job in job_list:
        assert Job.objects.get(pk=job.pk).state == "admitted"
        job_dispatch(job_id=job.pk)
    return [Job.objects.get(pk=job.pk) for job in job_list]


def _head_run(job: Job) -> Run:
    return Run.objects.filter(job=job, node_rank=0).order_by("-attempt").first()


def _start(run: Run) -> None:
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 4242})


def test_eight_jobs_on_one_node_hold_eight_different_ports_each_its_plan_says(
    team, researcher, quota, ports
):
    (node,) = _nodes(1)
    ports(8)  # exactly as many ports as jobs: any repeat would leave one without
    placed = _placed_and_dispatched([_submit(team, researcher) for _ in range(8)])
    assert {job.state for job in placed} == {"starting"}
    heads = [_head_run(job) for job in placed]
    assert {run.node_id for run in heads} == {node.pk}
    taken = sorted(run.rendezvous_port for run in heads)
    assert taken == list(range(BASE, BASE + 8))
    for run in heads:
        assert run.rendezvous_host == "127.0.0.1"
        assert run.plan["env"]["MASTER_PORT"] == str(run.rendezvous_port)
        assert run.plan["env"]["MASTER_ADDR"] == "127.0.0.1"
        # One node, a command: nothing of its own listens on the port, so nothing to check.
        assert "rendezvous_port" not in run.plan


def test_a_two_node_trainer_names_one_port_everywhere_and_rank_0_checks_it(
    team, researcher, quota, ports
):
    _nodes(2)
    spec = trainer_spec(team, preset="tiny", nodes=2, gpus_per_node=8, seq_len=256)
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=researcher)
    (job,) = _placed_and_dispatched([job])
    runs = list(Run.objects.filter(job=job).order_by("node_rank"))
    port = runs[0].rendezvous_port
    assert BASE <= port < BASE + 1000
    for run in runs:
        assert f"--rdzv-endpoint=127.0.0.1:{port}" in run.plan["argv"]
        assert f"--rdzv-conf=is_host={int(run.node_rank == 0)}" in run.plan["argv"]
        assert run.plan["env"]["MASTER_PORT"] == str(port)
    assert runs[0].plan["rendezvous_port"] == port
    assert runs[1].rendezvous_port is None and "rendezvous_port" not in runs[1].plan


def test_no_free_port_requeues_the_job_and_says_so(team, researcher, quota, ports):
    (node,) = _nodes(1)
    ports(2)
    first, second, third = _placed_and_dispatched([_submit(team, researcher) for _ in range(3)])
    assert (first.state, second.state) == ("starting", "starting")
    assert third.state == "pending" and third.restarts == 1
    assert third.state_reason == (
        f"requeued: no free rendezvous port on {node.name} (127.0.0.1): "
        f"all 2 from {BASE} to {BASE + 1} are held by other jobs"
    )
    assert not Run.objects.filter(job=third).exists()


def test_a_port_is_held_until_its_run_has_ended_then_given_again(team, researcher, quota, ports):
    _nodes(1)
    ports(1)
    (first,) = _placed_and_dispatched([_submit(team, researcher)])
    run = _head_run(first)
    _start(run)
    # Requeued, its process asked to stop but not gone yet: it still listens on the port.
    jobs.job_requeue(job=first, by=None, reason="ops wants the node")
    run.refresh_from_db()
    assert run.state == "running" and run.stop_requested_at is not None
    (second,) = _placed_and_dispatched([_submit(team, researcher)])
    assert second.state == "pending"
    assert "no free rendezvous port" in second.state_reason

    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", "exit_code": 0})
    assert Job.objects.get(pk=first.pk).state == "pending"
    scheduling_pass()
    assert job_dispatch(job_id=second.pk).state == "starting"
    assert _head_run(second).rendezvous_port == BASE


def test_a_finished_job_gives_its_port_back(team, researcher, quota, ports):
    _nodes(1)
    ports(1)
    (first,) = _placed_and_dispatched([_submit(team, researcher)])
    run = _head_run(first)
    _start(run)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", "exit_code": 0})
    assert Job.objects.get(pk=first.pk).state == "succeeded"
    (second,) = _placed_and_dispatched([_submit(team, researcher)])
    assert second.state == "starting" and _head_run(second).rendezvous_port == BASE


def test_heads_on_different_addresses_may_use_the_same_port(team, researcher, quota, ports):
    _nodes(2, addresses=["10.0.0.1", "10.0.0.2"])
    ports(1)
    placed = _placed_and_dispatched([_submit(team, researcher, gpus=8) for _ in range(2)])
    assert [job.state for job in placed] == ["starting", "starting"]
    heads = [_head_run(job) for job in placed]
    assert {run.rendezvous_host for run in heads} == {"10.0.0.1", "10.0.0.2"}
    assert {run.rendezvous_port for run in heads} == {BASE}


def test_the_database_refuses_a_second_open_run_on_a_held_port(team, researcher, quota, ports):
    _nodes(1)
    (job,) = _placed_and_dispatched([_submit(team, researcher)])
    held = _head_run(job)
    twin = Run(
        job=job,
        node_id=held.node_id,
        attempt=held.attempt + 1,
        node_rank=0,
        plan={},
        rendezvous_host=held.rendezvous_host,
        rendezvous_port=held.rendezvous_port,
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        twin.save()
    Run.objects.filter(pk=held.pk).update(state="exited", ended_at=timezone.now())
    twin.save()  # the first run has ended: its port is free


@pytest.mark.parametrize(
    ("report", "state", "reason"),
    [
        (
            {
                "reason": f"rendezvous port {BASE} is busy on this node",
                "node_fault": NodeFault.RENDEZVOUS_PORT_BUSY,
            },
            "pending",
            f"could not start: rendezvous port {BASE} is busy on this node (infrastructure)",
        ),
        # The same words without the agent saying it is the node's fault: the job's own.
        ({"reason": f"rendezvous port {BASE} is busy on this node"}, "failed", "is busy on"),
        ({"reason": "git exited 128", "node_fault": "made_up"}, "failed", "git exited 128"),
    ],
)
def test_a_refusal_is_the_nodes_fault_only_when_the_agent_says_so(
    team, researcher, quota, ports, report, state, reason
):
    _nodes(2)
    (job,) = _placed_and_dispatched([_submit(team, researcher, gpus=16)])
    head = _head_run(job)
    _start(Run.objects.get(job=job, node_rank=1))
    run_report(node_id=head.node_id, run_id=head.pk, report={"state": "refused", **report})
    job.refresh_from_db()
    assert job.state == state and reason in job.state_reason
    assert job.restarts == (1 if state == "pending" else 0)
    other = Run.objects.get(job=job, node_rank=1)
    assert other.stop_requested_at is not None  # the rank that waits is asked to stop


def test_the_next_attempt_does_not_take_the_port_found_busy(team, researcher, quota, ports):
    _nodes(2)
    ports(2)
    (job,) = _placed_and_dispatched([_submit(team, researcher, gpus=16)])
    head = _head_run(job)
    busy = head.rendezvous_port
    run_report(
        node_id=head.node_id,
        run_id=head.pk,
        report={
            "state": "refused",
            "reason": f"rendezvous port {busy} is busy on this node",
            "node_fault": NodeFault.RENDEZVOUS_PORT_BUSY,
        },
    )
    assert Job.objects.get(pk=job.pk).state == "pending"
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    again = _head_run(job)
    # Chosen at random among the free ports, but never the one found busy while another is.
    assert again.attempt == head.attempt + 1
    assert again.rendezvous_port == ({BASE, BASE + 1} - {busy}).pop()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_dispatches_at_once_on_one_node_never_share_a_port(team, researcher, quota, ports):
    """Four workers dispatch four jobs of one node at the same instant, with four ports: each
    reads them all free and chooses at random, so most runs of this test see two choose the
    same; the database lets one commit and the other chooses again."""
    _nodes(1)
    ports(4)
    placed = [_submit(team, researcher) for _ in range(4)]
    scheduling_pass()
    assert {Job.objects.get(pk=job.pk).state for job in placed} == {"admitted"}
    start, errors = threading.Barrier(len(placed)), []

    def dispatch(job_id: int) -> None:
        try:
            start.wait()
            job_dispatch(job_id=job_id)
        except Exception as exc:  # reported below, with the others
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=dispatch, args=(job.pk,)) for job in placed]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert errors == []
    assert {Job.objects.get(pk=job.pk).state for job in placed} == {"starting"}
    assert sorted(_head_run(job).rendezvous_port for job in placed) == list(range(BASE, BASE + 4))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_dispatch_that_loses_the_last_port_to_another_requeues_with_the_reason(
    team, researcher, quota, ports
):
    """The first dispatch holds the one port uncommitted; the second, which read it free,
    waits on the constraint, loses when the first commits, reads again and finds none."""
    (node,) = _nodes(1)
    ports(1)
    first, second = (_submit(team, researcher) for _ in range(2))
    scheduling_pass()
    written, commit, errors = threading.Event(), threading.Event(), []

    def dispatch_and_hold() -> None:
        try:
            with transaction.atomic():
                job_dispatch(job_id=first.pk)
                written.set()
                commit.wait(timeout=30)
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            written.set()
            connection.close()

    def dispatch() -> None:
        try:
            job_dispatch(job_id=second.pk)
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    holder, loser = threading.Thread(target=dispatch_and_hold), threading.Thread(target=dispatch)
    holder.start()
    assert written.wait(timeout=30)
    loser.start()
    _wait_for_a_lock_wait()
    commit.set()
    holder.join(timeout=30)
    loser.join(timeout=30)
    assert errors == []
    assert Job.objects.get(pk=first.pk).state == "starting"
    second = Job.objects.get(pk=second.pk)
    assert second.state == "pending"
    assert second.state_reason.startswith(f"requeued: no free rendezvous port on {node.name}")


def _wait_for_a_lock_wait(timeout_s: float = 30.0) -> None:
    """Until another session of this database waits on a lock (the second insert)."""
    import time

    deadline = time.monotonic() + timeout_s
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.05)
    raise AssertionError("the second dispatch never waited on the first")
