"""The node agents' job endpoints: the work to start and stop, run reports, output, spot notices.

Authenticated by node token like the fleet's agent endpoints (apps/fleet/api/agent.py);
a node sees and reports only its own runs.
"""

from apps.fleet import agents
from apps.fleet.api.agent import agent_endpoint
from apps.jobs import dispatch


@agent_endpoint("GET")
def work(request, identity, body):
    have = dispatch.agent_have(request.GET.get("have"))
    return dispatch.agent_work(node_id=identity.node_id, have=have)


@agent_endpoint("POST")
def run_status(request, identity, body, run_id: int):
    run = dispatch.run_report(node_id=identity.node_id, run_id=run_id, report=body)
    return {"id": run.pk, "state": run.state}


@agent_endpoint("POST")
def run_logs(request, identity, body, run_id: int):
    stored = dispatch.run_logs_append(
        node_id=identity.node_id,
        run_id=run_id,
        lines=body.get("lines", []),
        dropped=body.get("dropped", 0),
    )
    return {"stored": stored}


@agent_endpoint("POST")
def events(request, identity, body):
    if body.get("kind") != "spot_interruption":
        return {"ignored": True}
    notice = body.get("notice") if isinstance(body.get("notice"), dict) else {}
    agents.node_spot_interruption_record(node_id=identity.node_id, notice=notice)
    return {"jobs": dispatch.spot_interruption_handle(node_id=identity.node_id, notice=notice)}
