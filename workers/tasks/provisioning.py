"""Bringing nodes up and down: the fleet's services on one side, the providers on the other.

This is where Django meets workers/providers (which take plain dataclasses and
never import Django). Every step starts from the node's state in the database,
so a task that died half-way is simply run again: the providers' operations are
idempotent (aws: look-up by tag and ClientToken = the node's UUID).

    REQUESTED | FAILED | DRAINED → PROVISIONING → (ssh, key not pinned: AWAITING_HOST_KEY)
        → BOOTSTRAPPING → READY when the agent registers and passes its health checks
"""

import logging
import sys
from pathlib import Path

from celery import shared_task
from django.conf import settings

from workers.providers import errors
from workers.providers.bundle import Bundle
from workers.providers.local import LocalConfig, LocalNodeSpec, LocalProvider
from workers.providers.ssh import SshConfig, SshNodeSpec, SshProvider
from workers.tasks.aws_nodes import aws_provider_for, launch_record
from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)

AGENT_ARGV = ("python3", "-m", "workers.agent")
STARTABLE = ("requested", "failed", "drained", "provisioning", "bootstrapping")


def provider_for(node):
    """(provider, spec) for a node row."""
    if node.provider == "local":
        root = Path(settings.VAR_DIR) / "nodes"
        return (
            LocalProvider(LocalConfig(root=root)),
            LocalNodeSpec(uuid=str(node.uuid), name=node.name, slots=max(node.gpu_count, 1)),
        )
    if node.provider == "ssh":
        if not settings.SSH_KEY_FILE:
            raise errors.ConfigurationError(
                "SSH_KEY_FILE is not set: owned nodes cannot be reached."
            )
        return (
            SshProvider(
                SshConfig(key_file=Path(settings.SSH_KEY_FILE), remote_root=settings.SSH_NODE_ROOT)
            ),
            SshNodeSpec(
                uuid=str(node.uuid),
                address=node.address,
                port=node.ssh_port,
                user=node.ssh_user or "root",
                host_key=node.host_key,
                name=node.name,
            ),
        )
    if node.provider == "aws":
        return aws_provider_for(node)
    raise errors.ConfigurationError(f"provider {node.provider!r} is provisioned elsewhere")


def agent_bundle(node, *, token: str) -> Bundle:
    agent_env = {
        "CONTROLPLANE_URL": settings.CONTROLPLANE_URL,
        "CONTROLPLANE_NODE_TOKEN": token,
        "AGENT_HEARTBEAT_S": str(settings.AGENT_HEARTBEAT_S),
    }
    argv = AGENT_ARGV
    if node.provider == "ssh":
        argv = (settings.SSH_NODE_PYTHON, "-m", "workers.agent")
    if node.provider == "local":
        agent_env["AGENT_SLOTS"] = str(node.gpu_count)
        # A local node is this machine: its Python is the worker's own (the venv with torch
        # under `make run`), and the agent hands it to the runs it starts.
        argv = (sys.executable, "-m", "workers.agent")
    if settings.AGENT_IMDS_URL:  # owned nodes have no instance metadata; tests stand one in
        agent_env["AGENT_IMDS_URL"] = settings.AGENT_IMDS_URL
        agent_env["AGENT_SPOT_POLL_S"] = str(settings.AGENT_SPOT_POLL_S)
    return Bundle(agent_argv=argv, agent_env=agent_env)


def _bootstrap(node, provider, spec, progress=None) -> None:
    from apps.fleet import agents

    token = agents.node_agent_token_issue(node=node)
    bundle = agent_bundle(node, token=token)
    provider.bootstrap(spec, bundle, restart_agent=True, progress=progress)
    if node.provider == "aws":  # a running instance has its address now
        launch_record(node_id=node.pk, description=provider.describe(spec))


def provision_node(node_id: int) -> str:
    """Take a node as far up as it can go now; returns the state it reached.

    Raises a retryable ProviderError when trying again later may work (the task retries).
    """
    from apps.fleet import agents, selectors
    from apps.fleet import services as fleet

    node = selectors.node_get(node_id=node_id)
    if node.state not in STARTABLE and node.state != "awaiting_host_key":
        return node.state
    if node.state in ("requested", "failed", "drained"):
        node = fleet.node_transition(node=node, to="provisioning", reason="provisioning", by=None)

    def progress(step: str, percent: int, message: str) -> None:
        agents.node_progress(node=node, step=step, percent=percent, message=message)

    try:
        provider, spec = provider_for(node)
        if node.state in ("provisioning", "awaiting_host_key"):
            try:
                launch_record(node_id=node.pk, description=provider.create(spec, progress=progress))
            except errors.HostKeyUnknown as exc:
                if node.state == "provisioning":
                    fleet.node_host_key_offer(node=node, offered_key=exc.offered_key)
                progress("host key", 20, f"waiting for ops to accept {exc.fingerprint}")
                return "awaiting_host_key"
            node = fleet.node_transition(
                node=node, to="bootstrapping", reason="reached; bootstrapping", by=None
            )
        _bootstrap(node, provider, spec, progress)
        progress("agent", 90, "agent started; waiting for it to register")
    except errors.ProviderError as exc:
        if exc.retryable:
            progress("retrying", 0, str(exc)[:300])
            raise
        reason = f"{type(exc).__name__}: {exc}"[:300]
        progress("failed", 0, reason)
        node.refresh_from_db()
        if node.state in ("provisioning", "awaiting_host_key", "bootstrapping"):
            fleet.node_transition(node=node, to="failed", reason=reason, by=None)
        return "failed"
    return selectors.node_get(node_id=node_id).state


def terminate_node(node_id: int) -> str:
    """Stop the node's agent and remove what bootstrap put there (local, ssh)."""
    from apps.fleet import agents, selectors
    from apps.fleet import services as fleet

    node = selectors.node_get(node_id=node_id)
    if node.state == "terminated":
        return node.state
    if node.state != "terminating":
        node = fleet.node_transition(node=node, to="terminating", reason="terminating", by=None)
    provider, spec = provider_for(node)
    provider.terminate(spec)
    agents.node_agent_token_revoke(node=node)
    fleet.node_transition(node=node, to="terminated", reason="terminated", by=None)
    return "terminated"


def local_nodes_revive() -> dict[str, int]:
    """Local nodes are processes of this machine: after a restart of `make run` their agents
    are gone while their rows say READY. Start those agents again, with new tokens."""
    from apps.fleet.selectors import local_nodes_live

    counts = {"restarted": 0}
    for node in local_nodes_live():
        if node.state in ("requested", "provisioning"):
            continue  # a provisioning task is on its way
        provider, spec = provider_for(node)
        if not provider.describe(spec).agent_alive:
            _bootstrap(node, provider, spec)
            counts["restarted"] += 1
    return counts


def agent_upgrade_node(node_id: int) -> str:
    """Copy the agent this control plane ships to an owned or local node and restart it.

    Only while no run is open there: the agent's restart would stop the job's processes.
    Cloud nodes are not upgraded in place: they fetch the current agent when launched.
    """
    from apps.fleet import agents
    from apps.fleet.selectors import node_get
    from apps.jobs.selectors import node_has_open_runs

    node = node_get(node_id=node_id)
    if node.provider not in ("local", "ssh") or node.state not in ("ready", "drained"):
        return "skipped"
    if not agents.version_older(node.agent_version, settings.AGENT_VERSION):
        return "current"
    if node_has_open_runs(node_id=node.pk):
        return "busy"
    provider, spec = provider_for(node)
    _bootstrap(node, provider, spec)
    return "upgraded"


@shared_task(name="fleet.agent_upgrade", bind=True, acks_late=True, max_retries=48)
def agent_upgrade(self, node_id: int) -> str:
    from apps.accounts.context import Origin, acting_from

    with acting_from(Origin(channel="task", label="task:fleet.agent_upgrade")):
        outcome = agent_upgrade_node(node_id)
    if outcome == "busy":  # try again when its job may have ended
        raise self.retry(countdown=300)
    return outcome


@shared_task(name="fleet.local_nodes_revive", acks_late=True)
def local_nodes_revive_task() -> dict:
    from apps.accounts.context import Origin, acting_from

    with acting_from(Origin(channel="task", label="task:fleet.local_nodes_revive")):
        return local_nodes_revive()


@shared_task(
    name="fleet.provision",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=8,
)
def provision(self, node_id: int) -> str:
    from apps.accounts.context import Origin, acting_from

    # One provisioning of a node at a time: a re-driven one finds the first still going.
    with single_flight(f"fleet.provision:{node_id}", ttl_s=3600) as ours:
        if not ours:
            return "already being provisioned"
        with acting_from(Origin(channel="task", label="task:fleet.provision")):
            try:
                return provision_node(node_id)
            except errors.ProviderError as exc:
                log.warning("provisioning node %s: %s (retrying)", node_id, exc)
                countdown = min(300, 5 * 2**self.request.retries)
                raise self.retry(exc=exc, countdown=countdown) from exc


@shared_task(name="fleet.provisioning_redrive", acks_late=True)
def provisioning_redrive() -> dict:
    """Take up again the owned nodes whose provisioning stalled (apps/fleet/services.py
    owned_nodes_stalled), each at most once per OWNED_REDRIVE_AFTER_S."""
    from django.conf import settings

    from apps.fleet.services import owned_nodes_stalled
    from controlplane.cache import best_effort
    from controlplane.celery import app

    redriven = []
    for node_id in owned_nodes_stalled():
        key = f"fleet:owned-redrive:{node_id}"
        if not best_effort.add(key, 1, timeout=settings.OWNED_REDRIVE_AFTER_S):
            continue
        try:
            app.send_task("fleet.provision", args=[node_id])
            redriven.append(node_id)
        except Exception:
            log.warning("could not re-drive provisioning of node %s", node_id, exc_info=True)
    if redriven:
        log.info("provisioning re-driven for nodes %s", redriven)
    return {"redriven": len(redriven)}


@shared_task(name="fleet.terminate", acks_late=True, reject_on_worker_lost=True)
def terminate(node_id: int) -> str:
    from apps.accounts.context import Origin, acting_from

    with acting_from(Origin(channel="task", label="task:fleet.terminate")):
        return terminate_node(node_id)
