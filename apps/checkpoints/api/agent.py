"""The node agents' checkpoint endpoints (node tokens, apps/fleet/api/agent.py): the trainer's
checkpoint lines as reports, the work asked of the node (checks, deletions, listings,
exports), and its answers. A node reports only on its own runs and answers only what it was
asked. The protocol is described in workers/agent/checkpoints.py."""

from apps.checkpoints import selectors, services
from apps.checkpoints.api.reports import checkpoint_report_parse
from apps.fleet.api.agent import agent_endpoint
from apps.jobs.selectors import run_on_node
from controlplane.errors import ApplicationError


@agent_endpoint("POST")
def events(request, identity, body):
    run_id = body.get("run")
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 0 < run_id < 2**63:
        raise services.invalid_input("run", "The run's id.")
    run = run_on_node(node_id=identity.node_id, run_id=run_id)
    if run is None:
        raise ApplicationError("No such run on this node.", code="not_found", status=404)
    report = checkpoint_report_parse(body.get("event"))
    if report is None:
        return {"ignored": True}
    return services.checkpoint_event_record(run=run, report=report)


@agent_endpoint("GET")
def work(request, identity, body):
    return services.agent_work_vet(work=selectors.agent_checkpoint_work(node_id=identity.node_id))


@agent_endpoint("POST")
def verification(request, identity, body, copy_id: int):
    ok = body.get("ok")
    if not isinstance(ok, bool):
        raise services.invalid_input("ok", "true or false.")
    copy = services.copy_verification_record(
        copy_id=copy_id,
        ok=ok,
        missing=body.get("missing") is True,
        problem=str(body.get("problem") or "")[:500],
        node_id=identity.node_id,
    )
    return {"id": copy.pk, "state": copy.state}


@agent_endpoint("POST")
def deletion(request, identity, body, copy_id: int):
    copy = services.copy_deletion_record(
        copy_id=copy_id,
        outcome=str(body.get("outcome") or ""),
        message=str(body.get("message") or "")[:500],
        node_id=identity.node_id,
    )
    return {"id": copy.pk, "state": copy.state}


@agent_endpoint("POST")
def sweep(request, identity, body, sweep_id: int):
    done = services.sweep_record(node_id=identity.node_id, sweep_id=sweep_id, report=body)
    return {"id": done.pk, "result": done.result}


@agent_endpoint("POST")
def export(request, identity, body, export_id: int):
    done = services.export_record(node_id=identity.node_id, export_id=export_id, report=body)
    return {"id": done.pk, "state": done.state}
