"""`cpctl`: the command-line client for CI and people, over the REST API.

Standard library only (it runs in CI images without Django). Configuration from
the environment: CPCTL_URL (default http://127.0.0.1:8000) and CPCTL_TOKEN.
Exit codes: 0 done, 1 the API said no (its error is printed), 2 bad usage or no
connection.
"""

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    def __init__(self, status: int, body: dict):
        self.status = status
        self.body = body
        error = body.get("error", {}) if isinstance(body, dict) else {}
        message = error.get("message") or f"HTTP {status}"
        details = error.get("details") or {}
        if details:
            message += " " + "; ".join(
                f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in details.items()
            )
        super().__init__(message)


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict | None = None, query: dict | None = None):
        url = f"{self.url}/api/v1/{path.lstrip('/')}"
        if query:
            url += "?" + urllib.parse.urlencode(
                {k: v for k, v in query.items() if v is not None}, doseq=True
            )
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)  # noqa: S310
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                parsed = json.loads(raw or b"{}")
            except ValueError:
                parsed = {"error": {"message": raw.decode(errors="replace")[:200]}}
            raise ApiError(exc.code, parsed) from None
        return json.loads(raw) if raw else None

    def all_pages(self, path: str, query: dict | None = None):
        query = {**(query or {}), "page_size": 1000, "page": 1}
        while True:
            page = self.request("GET", path, query=query)
            yield from page["results"]
            if not page.get("next"):
                return
            query["page"] += 1


def _print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


def _emit(args, rows, columns):
    if args.output == "json":
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        _print_table(rows if isinstance(rows, list) else [rows], columns)


def _node_id(client: Client, name: str) -> int:
    matches = [n for n in client.all_pages("nodes/", {"q": name}) if n["name"] == name]
    if not matches:
        raise ApiError(404, {"error": {"message": f"No node named {name}."}})
    return matches[0]["id"]


def cmd_whoami(client, args):
    me = client.request("GET", "me/")
    if args.output == "json":
        _emit(args, me, [])
        return
    teams = ", ".join(f"{t['slug']} ({t['role']})" for t in me["teams"]) or "none"
    roles = ", ".join(me["org_roles"]) or "none"
    print(
        f"{me['username']}: teams {teams}; organisation roles {roles}; "
        f"token scopes {', '.join(me['token_scopes'] or ['session'])}"
    )


def cmd_nodes(client, args):
    rows = list(client.all_pages("nodes/", {"state": args.state, "pool_id": args.pool_id}))
    _emit(
        args,
        rows,
        [
            "name",
            "state",
            "provider",
            "capacity_type",
            "gpu_type",
            "gpu_count",
            "last_heartbeat_at",
        ],
    )


def cmd_drain(client, args):
    node = client.request(
        "POST", f"nodes/{_node_id(client, args.node)}/drain/", {"reason": args.reason}
    )
    _emit(args, node, ["name", "state", "state_reason"])


def cmd_undrain(client, args):
    node = client.request("POST", f"nodes/{_node_id(client, args.node)}/undrain/")
    _emit(args, node, ["name", "state", "state_reason"])


def cmd_teams(client, args):
    _emit(args, list(client.all_pages("teams/")), ["id", "slug", "name"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpctl", description="GPU control plane client.")
    parser.add_argument("--url", default=os.environ.get("CPCTL_URL", DEFAULT_URL))
    parser.add_argument("--output", "-o", choices=["table", "json"], default="table")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("whoami", help="who the token belongs to").set_defaults(run=cmd_whoami)
    nodes = sub.add_parser("nodes", help="list nodes")
    nodes.add_argument("--state", action="append")
    nodes.add_argument("--pool-id", type=int)
    nodes.set_defaults(run=cmd_nodes)
    drain = sub.add_parser("drain", help="drain a node (ops)")
    drain.add_argument("node")
    drain.add_argument("--reason", required=True)
    drain.set_defaults(run=cmd_drain)
    undrain = sub.add_parser("undrain", help="return a drained node to service (ops)")
    undrain.add_argument("node")
    undrain.set_defaults(run=cmd_undrain)
    sub.add_parser("teams", help="list your teams").set_defaults(run=cmd_teams)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.url, os.environ.get("CPCTL_TOKEN", ""))
    try:
        args.run(client, args)
    except ApiError as exc:
        print(f"cpctl: {exc}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"cpctl: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
