"""`cpctl`: the command-line client for CI and people, over the REST API.

Standard library only (it runs in CI images without Django). Configuration from
the environment: CPCTL_URL (default http://127.0.0.1:8000) and CPCTL_TOKEN.
Exit codes: 0 done, 1 the API said no (its error is printed) or `nccl-lint` found an
error, 2 bad usage or no connection; waiting for a job or a tuning run, 3 it failed and 4
it was cancelled.
"""

import argparse
import json
import os
import sys
import time
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

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        query: dict | None = None,
        headers: dict | None = None,
    ):
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
        for name, value in (headers or {}).items():
            request.add_header(name, value)
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

    def pages(self, path: str, query: dict | None = None, page_size: int = 1000):
        """A paginated list's pages (count, next, results), one request each."""
        query = {**(query or {}), "page_size": page_size, "page": 1}
        while True:
            page = self.request("GET", path, query=query)
            yield page
            if not page.get("next"):
                return
            query["page"] += 1

    def all_pages(self, path: str, query: dict | None = None):
        for page in self.pages(path, query):
            yield from page["results"]


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


FINISHED = {"succeeded": 0, "failed": 3, "cancelled": 4}


class SpecFileError(Exception):
    """A job spec file that cannot be read or parsed (exit 2, nothing sent)."""


def _load_spec(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise SpecFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SpecFileError(f"cannot read {path}: it is not UTF-8 text") from None
    if path.endswith((".yaml", ".yml")):
        import yaml  # PyYAML comes with the project; JSON specs need nothing

        try:
            return yaml.load(text, Loader=_spec_loader())  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as exc:
            raise SpecFileError(f"{path} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SpecFileError(f"{path} is not valid JSON: {exc}") from None


def _spec_loader():
    """PyYAML's safe loader, but a date-like value (`name: 2026-12-01`) stays the string
    it reads as: a spec has no dates, and JSON, which the API takes, has no date type."""
    import yaml

    class SpecLoader(yaml.SafeLoader):
        pass

    SpecLoader.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if not tag.endswith(":timestamp")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return SpecLoader


def _team_id(client: Client, team) -> int:
    if isinstance(team, int):
        return team
    for row in client.all_pages("teams/", {"slug": team}):
        if row["slug"] == team:
            return row["id"]
    raise ApiError(404, {"error": {"message": f"You are in no team called {team}."}})


def _wait(client: Client, job_id: int, *, poll_s: float) -> int:
    last = None
    while True:
        job = client.request("GET", f"jobs/{job_id}/")
        shown = (job["state"], job.get("pending_reason") or job.get("state_reason"))
        if shown != last:
            print(f"job {job_id}: {shown[0]}" + (f" ({shown[1]})" if shown[1] else ""), flush=True)
            last = shown
        if job["state"] in FINISHED:
            return FINISHED[job["state"]]
        time.sleep(poll_s)


def cmd_submit(client, args):
    if args.poll is None:
        args.poll = 2.0 if args.follow else 10.0
    spec = _load_spec(args.file)
    if not isinstance(spec, dict) or "team" not in spec:
        raise ApiError(400, {"error": {"message": f"{args.file}: a job spec with a team."}})
    spec["team"] = _team_id(client, spec["team"])
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = client.request("POST", "jobs/", spec, headers=headers)
    if args.output == "json":
        _emit(args, job, [])
    else:
        print(
            f"job {job['id']} {job['state']}: {job['name']} "
            f"({job['nodes']} × {job['gpus_per_node']} {job['gpu_type']})",
            flush=True,  # a CI log shows it now, not when the wait is over
        )
    if args.follow:
        return _follow(client, job["id"], poll_s=args.poll)
    if args.wait:
        return _wait(client, job["id"], poll_s=args.poll)
    return 0


FIT_WORDS = {"fits": "fits", "tight": "tight", "no": "does not fit"}


def cmd_estimate(client, args):
    """Before submitting: per GPU type, each layout's fit, memory per GPU, run time and cost,
    the suggested layout and what the figures rest on. Nothing is submitted."""
    spec = _load_spec(args.file)
    if not isinstance(spec, dict) or "team" not in spec:
        raise ApiError(400, {"error": {"message": f"{args.file}: a job spec with a team."}})
    spec["team"] = _team_id(client, spec["team"])
    answer = client.request("POST", "jobs/estimate/", spec)
    if args.output == "json":
        _emit(args, answer, [])
        return 0
    for number, advice in enumerate(answer):
        if number:
            print()
        print(f"{advice['gpu_type']}, {advice['gpus']} GPUs:")
        rows = []
        for layout in advice["layouts"]:
            marks = [
                mark
                for mark, layout_is in (
                    ("asked", layout == advice["chosen"]),
                    ("suggested", layout == advice["suggested"]),
                )
                if layout_is
            ]
            rows.append(
                {
                    "layout": layout["label"],
                    "fit": FIT_WORDS[layout["fit"]],
                    "gib_per_gpu": f"{layout['memory_gib']:.1f} of {layout['gpu_memory_gib']:.0f}",
                    "run_time": _duration(layout["run_time_s"]),
                    "cost": "—" if layout["cost"] is None else f"${layout['cost']}",
                    "": ", ".join(marks),
                }
            )
        _print_table(rows, ["layout", "fit", "gib_per_gpu", "run_time", "cost", ""])
        chosen, suggested = advice["chosen"], advice["suggested"]
        if chosen is not None and chosen["fit"] == "no":
            print(
                f"{chosen['label']} does not fit: it needs {chosen['memory_gib']:g} GiB per GPU; "
                f"an {advice['gpu_type']} has {chosen['gpu_memory_gib']:.0f}."
            )
        if suggested is not None:
            print(f"suggested: {suggested['label']} ({suggested['memory_gib']:g} GiB per GPU)")
        else:
            print(f"suggested: none (no layout of {advice['gpus']} GPUs fits)")
        for line in advice["basis"]:
            print(f"basis: {line}")
    return 0


def _duration(seconds) -> str:
    if seconds is None:
        return "—"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours} h {rest // 60:02d} m" if hours else f"{rest // 60} m {rest % 60:02d} s"


def _follow(client: Client, job_id: int, *, poll_s: float) -> int:
    """submit --wait --follow (or --follow alone): the job's output on stdout as it comes,
    each state it moves to on stderr (so stdout is the job's own output), then its outcome
    as the exit code."""
    seen = []

    def states(state: str) -> None:
        if not seen or seen[-1] != state:
            seen.append(state)
            print(f"job {job_id}: {state}", file=sys.stderr, flush=True)

    return _stream_logs(client, job_id, follow=True, poll_s=poll_s, states=states)


def cmd_status(client, args):
    job = client.request("GET", f"jobs/{args.job}/")
    if args.output == "json":
        _emit(args, job, [])
        return 0
    print(f"job {job['id']} {job['name']}: {job['state']}")
    if job.get("pending_reason"):
        print(f"  waiting: {job['pending_reason']}")
    if job.get("estimated_start"):
        print(f"  estimated start: {job['estimated_start']}")
    for event in job.get("events", []):
        print(
            f"  {event['at']}  {event['from_state'] or '·':>12} → {event['to_state']:<12} "
            f"{event['reason']}"
        )
    return 0


def _print_lines(lines: list[dict], *, multi_rank: bool) -> None:
    for line in lines:
        prefix = f"[{line['rank']}] " if multi_rank else ""
        stream = sys.stderr if line["stream"] == "stderr" else sys.stdout
        print(prefix + line["text"], file=stream, flush=True)


def _stream_logs(
    client: Client, job_id: int, *, follow: bool, poll_s: float, states=None, filters=None
) -> int:
    """Print the job's output from its first line; with `follow`, until the job ends, then
    its outcome as an exit code (as with submit --wait). `states`, if given, is told each
    state the job is seen in (the logs answer carries it). `filters` (rank, attempt, q) are
    the logs API's, passed as they are."""
    job = client.request("GET", f"jobs/{job_id}/")
    multi_rank = job["nodes"] > 1
    filters = filters or {}
    after = 0
    while True:
        page = client.request(
            "GET", f"jobs/{job_id}/logs/", query={**filters, "after": after, "limit": 1000}
        )
        if states is not None:
            states(page["state"])
        _print_lines(page["lines"], multi_rank=multi_rank)
        after = page["next_after"]
        if len(page["lines"]) == 1000:
            continue  # more is waiting: no pause
        if not follow:
            return 0
        if page["finished"]:
            # The agents relay output apart from the exit: one more look for late lines.
            time.sleep(min(poll_s, 2.0))
            late = client.request("GET", f"jobs/{job_id}/logs/", query={**filters, "after": after})
            _print_lines(late["lines"], multi_rank=multi_rank)
            return FINISHED.get(page["state"], 0)
        time.sleep(poll_s)


def cmd_logs(client, args):
    """A job's output; with --follow, until the job ends (exit code as with submit --wait)."""
    filters = {"rank": args.rank, "attempt": args.attempt, "q": args.grep}  # None: not sent
    return _stream_logs(client, args.job, follow=args.follow, poll_s=args.poll, filters=filters)


def cmd_cancel(client, args):
    job = client.request("POST", f"jobs/{args.job}/cancel/", {"reason": args.reason or ""})
    _emit(args, job, ["id", "name", "state", "state_reason"])
    return 0


def _first(client: Client, path: str, query: dict, limit: int, which: str) -> list[dict]:
    """The first `limit` rows of a paginated list (0: all), saying on stderr how many more
    there are ("the first 100 of 4,000 jobs")."""
    rows: list[dict] = []
    total = 0
    for page in client.pages(path, query, page_size=min(limit or 1000, 1000)):
        rows += page["results"]
        total = page["count"]
        if limit and len(rows) >= limit:
            break
    rows = rows[: limit or None]
    if len(rows) < total:
        print(
            f"cpctl: the {which} {len(rows)} of {total} jobs (--limit 0 for all)", file=sys.stderr
        )
    return rows


def cmd_queue(client, args):
    """The front of the queue (`--limit`, 0 for every job), filtered by state and team."""
    rows = _first(client, "queue/", {"state": args.state, "team": args.team}, args.limit, "first")
    for row in rows:
        row["name"] = row.get("name") or "(another team's job)"
        row["id"] = row["id"] or ""
    _emit(
        args,
        rows,
        [
            "position",
            "id",
            "team",
            "name",
            "state",
            "priority",
            "gpus",
            "gpu_type",
            "estimated_start",
        ],
    )
    return 0


def cmd_jobs(client, args):
    """Your teams' jobs, newest first, in any state (`--state`, `--user`): what `sacct` is
    to Slurm, where `queue` is squeue."""
    rows = _first(client, "jobs/", {"state": args.state, "user": args.user}, args.limit, "latest")
    for row in rows:
        row["team"] = row["team_slug"]
        row["reason"] = row["state_reason"] or row.get("pending_reason") or ""
    _emit(
        args,
        rows,
        [
            "id",
            "team",
            "name",
            "state",
            "reason",
            "gpus",
            "gpu_type",
            "submitted_at",
            "finished_at",
        ],
    )
    return 0


def cmd_dataset_register(client, args):
    """Register a dataset from its index.json (what `python -m workers.trainer.prepare`
    wrote beside the shards), read here and sent whole."""
    index = _load_spec(args.index)
    body = {"team": _team_id(client, args.team), "name": args.name, "uri": args.uri}
    dataset = client.request("POST", "datasets/", {**body, "index": index})
    if args.output == "json":
        _emit(args, dataset, [])
    else:
        print(
            f"dataset {dataset['id']} {dataset['name']}: {dataset['shards']} shards, "
            f"{dataset['tokens']} tokens, vocabulary {dataset['vocab_size']} ({dataset['uri']})"
        )
    return 0


def cmd_datasets(client, args):
    rows = list(client.all_pages("datasets/", {}))
    for row in rows:
        row.pop("index", None)
        row["team"] = row["team_slug"]
    _emit(
        args,
        rows,
        ["id", "team", "name", "uri", "tokenizer_name", "vocab_size", "shards", "tokens"],
    )
    return 0


def cmd_nccl_lint(client, args):
    """One verdict per variable of an environment block, from the server's linter."""
    try:
        with open(args.file, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        print(f"cpctl: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    body = {"text": text, "fabric": args.fabric or "", "nccl_version": args.nccl_version or ""}
    answer = client.request("POST", "nccl-lint/", body)
    if args.output == "json":
        _emit(args, answer, [])
    else:
        for verdict in answer["verdicts"]:
            line = f"{verdict['level']:<7} {verdict['name']}  {verdict['reason']}"
            if verdict.get("suggestions") and verdict["level"] == "error":
                line += f" (did you mean {' or '.join(verdict['suggestions'])}?)"
            print(line)
        counts = answer["counts"]
        print(
            f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['ok']} ok",
            file=sys.stderr,
        )
    return 1 if answer["counts"]["error"] else 0


# --- NCCL tuning runs and profile versions -----------------------------------------------------

# A run that stops changing on its own: measured and judged (or waiting for ops), or stopped.
TUNING_DONE = {
    "awaiting": 0,
    "adopted": 0,
    "nothing": 0,
    "declined": 0,
    "steady": 0,
    "drifted": 0,
    "failed": 3,
    "cancelled": 4,
}


def _candidate(text: str) -> dict:
    """--candidate NAME=VALUE[,NAME=VALUE]: one candidate's variables."""
    changes = {}
    for part in text.split(","):
        name, equals, value = part.partition("=")
        if not equals or not name.strip():
            raise argparse.ArgumentTypeError(f"{part!r} is not NAME=VALUE")
        changes[name.strip()] = value.strip()
    return changes


def _time_left(seconds) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return ", less than a minute left"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f", about {minutes} min left"
    return f", about {minutes // 60} h {minutes % 60:02d} min left"


def _progress_line(run: dict) -> str:
    progress = run["progress"]
    return f"{progress['done']}/{progress['total']} launches{_time_left(progress['eta_s'])}"


def _print_verdicts(run: dict) -> None:
    """What the adoption rule (or the drift test) said, and what became of it."""
    print(f"tuning run {run['id']} {run['state']}: {run['reason']}")
    result = run.get("result") or {}
    for label, verdict in sorted((result.get("verdicts") or {}).items()):
        mark = "faster" if verdict["adopt"] else "not adopted"
        print(f"  {label}: {mark}: {verdict['summary']}")
    for label, note in sorted((result.get("not_judged") or {}).items()):
        print(f"  {label}: {note}")
    if "verdict" in result:  # a drift check's one verdict
        print(f"  baseline: {result['verdict']['summary']}")
    version = run.get("adopted_version")
    if version:
        print(f"  adopted as {version['profile']} v{version['number']}")
    elif run["state"] == "awaiting":
        print(f"  approve with: cpctl tuning adopt {run['id']} (or decline)")


def _tuning_wait(client: Client, run_id: int, *, poll_s: float) -> int:
    """Progress lines as the run measures, then its verdicts; the exit code says how it
    ended (0 measured and judged, 3 failed, 4 cancelled)."""
    last = None
    while True:
        run = client.request("GET", f"tuning-runs/{run_id}/")
        shown = (run["state"], _progress_line(run) if run["state"] == "running" else "")
        if shown != last:
            print(shown[1] or f"tuning run {run_id}: {run['state']}", flush=True)
            last = shown
        if run["state"] in TUNING_DONE:
            _print_verdicts(run)
            return TUNING_DONE[run["state"]]
        time.sleep(poll_s)


def cmd_tuning_start(client, args):
    body = {"pool": args.pool}
    if args.nodes:
        body["nodes"] = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if args.rounds is not None:
        body["rounds"] = args.rounds
    if args.candidate:
        body["candidates"] = args.candidate
    if args.no_approval:
        body["approval_required"] = False
    if args.team:
        body["team"] = args.team
    run = client.request("POST", "tuning-runs/", body)
    if args.output == "json" and not args.wait:
        _emit(args, run, [])
        return 0
    print(
        f"tuning run {run['id']} {run['state']} on {run['pool']} "
        f"({len(run['nodes'])} nodes, {len(run['candidates']) - 1} candidates × "
        f"{run['rounds']} rounds; job {run['job']})",
        flush=True,
    )
    return _tuning_wait(client, run["id"], poll_s=args.poll) if args.wait else 0


def cmd_tuning_show(client, args):
    run = client.request("GET", f"tuning-runs/{args.run_id}/")
    if args.output == "json":
        _emit(args, run, [])
        return 0
    print(f"tuning run {run['id']} ({run['kind']}) on {run['pool']}: {run['state']}")
    print(f"  nodes: {', '.join(run['nodes'])}; job {run['job']}")
    print(f"  progress: {_progress_line(run)}")
    for candidate in run["candidates"]:
        changes = ", ".join(f"{k}={v}" for k, v in candidate["changes"].items()) or "—"
        print(f"  [{candidate['index']}] {candidate['label']} ({candidate['origin']}): {changes}")
    if run["state"] in TUNING_DONE:
        _print_verdicts(run)
    else:
        print(f"  {run['reason']}")
    return 0


def cmd_tuning_list(client, args):
    query = {"pool": args.pool, "state": args.state}
    rows = list(client.all_pages("tuning-runs/", query))
    for row in rows:
        row["progress_"] = f"{row['progress']['done']}/{row['progress']['total']}"
        version = row["adopted_version"]
        row["adopted"] = f"{version['profile']} v{version['number']}" if version else ""
    _emit(
        args,
        rows,
        ["id", "kind", "pool", "state", "progress_", "adopted", "created_at", "finished_at"],
    )
    return 0


def _tuning_decide(client, args, path: str, body=None):
    run = client.request("POST", f"tuning-runs/{args.run_id}/{path}/", body)
    if args.output == "json":
        _emit(args, run, [])
    else:
        _print_verdicts(run)
    return 0


def cmd_tuning_adopt(client, args):
    return _tuning_decide(client, args, "adopt")


def cmd_tuning_decline(client, args):
    return _tuning_decide(client, args, "decline", {"reason": args.reason or ""})


def cmd_tuning_cancel(client, args):
    return _tuning_decide(client, args, "cancel")


def cmd_nccl_versions(client, args):
    rows = list(client.all_pages(f"nccl-profiles/{args.profile}/versions/"))
    for row in rows:
        row["current"] = "yes" if row["current"] else ""
        row["made_by"] = row["made_by"] or ""
        row["tuning_run"] = row["tuning_run"] or ""
    _emit(args, rows, ["number", "current", "source", "made_at", "made_by", "tuning_run", "note"])
    return 0


def cmd_nccl_restore(client, args):
    profile = client.request(
        "POST", f"nccl-profiles/{args.profile}/versions/{args.number}/restore/"
    )
    if args.output == "json":
        _emit(args, profile, [])
    else:
        print(f"{profile['name']} is now version {profile['version']} (version {args.number}'s)")
    return 0


def _tuning_parsers(sub) -> None:
    tuning = sub.add_parser("tuning", help="NCCL tuning runs: start, follow, adopt (ops)")
    runs = tuning.add_subparsers(dest="tuning_command", required=True)
    start = runs.add_parser("start", help="measure a pool's NCCL settings against candidates")
    start.add_argument("pool", help="the pool's slug")
    start.add_argument("--nodes", help="node names, comma-separated (default: every ready one)")
    start.add_argument("--rounds", type=int, help="rounds of every setting (at least 5)")
    start.add_argument(
        "--candidate",
        action="append",
        type=_candidate,
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="a candidate of your own (repeat for more), measured with the generated ones",
    )
    start.add_argument(
        "--no-approval", action="store_true", help="adopt what passes the rule without asking"
    )
    start.add_argument("--team", help="the team whose GPU time it counts to (its slug)")
    start.add_argument(
        "--wait",
        action="store_true",
        help="print progress until it is measured and judged, then the verdicts: exit 0, "
        "3 failed, 4 cancelled",
    )
    start.add_argument("--poll", type=float, default=10.0, help="seconds between checks")
    start.set_defaults(run=cmd_tuning_start)
    show = runs.add_parser("show", help="a run: progress, candidates, verdicts")
    show.add_argument("run_id", type=int, metavar="ID")
    show.set_defaults(run=cmd_tuning_show)
    listing = runs.add_parser("list", help="tuning runs, newest first")
    listing.add_argument("--pool", help="only this pool's (its slug)")
    listing.add_argument("--state", help="only runs in this state (running, awaiting…)")
    listing.set_defaults(run=cmd_tuning_list)
    adopt = runs.add_parser("adopt", help="approve what the adoption rule chose (ops)")
    adopt.add_argument("run_id", type=int, metavar="ID")
    adopt.set_defaults(run=cmd_tuning_adopt)
    decline = runs.add_parser("decline", help="keep the baseline (ops)")
    decline.add_argument("run_id", type=int, metavar="ID")
    decline.add_argument("--reason")
    decline.set_defaults(run=cmd_tuning_decline)
    cancel = runs.add_parser("cancel", help="cancel a queued or running run (ops)")
    cancel.add_argument("run_id", type=int, metavar="ID")
    cancel.set_defaults(run=cmd_tuning_cancel)

    nccl = sub.add_parser("nccl", help="NCCL profiles' versions")
    profiles = nccl.add_subparsers(dest="nccl_command", required=True)
    versions = profiles.add_parser("versions", help="a profile's versions, newest first")
    versions.add_argument("profile", help="the profile's name")
    versions.set_defaults(run=cmd_nccl_versions)
    restore = profiles.add_parser("restore", help="make an earlier version current again (ops)")
    restore.add_argument("profile")
    restore.add_argument("number", type=int)
    restore.set_defaults(run=cmd_nccl_restore)


def count(text: str) -> int:
    """A non-negative whole number (argparse names it in its error)."""
    number = int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return number


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
    submit = sub.add_parser("submit", help="submit a job from a YAML or JSON spec")
    submit.add_argument("file")
    submit.add_argument(
        "--wait",
        action="store_true",
        help="wait for the end: exit 0 if it succeeded, 3 failed, 4 cancelled",
    )
    submit.add_argument(
        "--idempotency-key",
        default=os.environ.get("CPCTL_IDEMPOTENCY_KEY", ""),
        help="a retried submit with the same key makes no second job",
    )
    submit.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="print the job's output as it comes (its states on stderr) until it ends, as "
        "--wait does (which it implies)",
    )
    submit.add_argument(
        "--poll",
        type=float,
        default=None,
        help="seconds between checks (default 10; 2 with --follow)",
    )
    submit.set_defaults(run=cmd_submit)
    estimate = sub.add_parser(
        "estimate",
        help="before submitting a trainer spec: fit, memory per GPU, run time and cost of each "
        "layout, and the one to take",
    )
    estimate.add_argument("file")
    estimate.set_defaults(run=cmd_estimate)
    status = sub.add_parser("status", help="a job's state, reason and timeline")
    status.add_argument("job", type=int)
    status.set_defaults(run=cmd_status)
    logs = sub.add_parser("logs", help="a job's output (every rank), secrets masked")
    logs.add_argument("job", type=int)
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing until the job ends; exit 0 if it succeeded, 3 failed, 4 cancelled",
    )
    logs.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
    logs.add_argument("--rank", type=int, help="only this node rank's lines (0 for the first)")
    logs.add_argument("--attempt", type=int, help="only this attempt's lines (1 for the first)")
    logs.add_argument("--grep", metavar="TEXT", help="only the lines holding TEXT (any case)")
    logs.set_defaults(run=cmd_logs)
    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job", type=int)
    cancel.add_argument("--reason")
    cancel.set_defaults(run=cmd_cancel)
    queue = sub.add_parser("queue", help="the queue, in order")
    queue.add_argument("--state", help="only jobs in this state (pending, held, running…)")
    queue.add_argument("--team", help="only this team's jobs (its slug)")
    queue.add_argument(
        "--limit", type=count, default=100, help="show the first N jobs (default 100; 0 for all)"
    )
    queue.set_defaults(run=cmd_queue)
    jobs = sub.add_parser("jobs", help="your teams' jobs, newest first, finished ones too")
    jobs.add_argument("--state", help="only jobs in this state (succeeded, failed, cancelled…)")
    jobs.add_argument("--user", help="only jobs this user submitted (a username)")
    jobs.add_argument(
        "--limit", type=count, default=20, help="show the latest N jobs (default 20; 0 for all)"
    )
    jobs.set_defaults(run=cmd_jobs)
    dataset = sub.add_parser("dataset", help="register a dataset").add_subparsers(
        dest="dataset_command", required=True
    )
    register = dataset.add_parser("register", help="register a dataset from its index.json")
    register.add_argument("name", help="a slug, unique in the team")
    register.add_argument("--team", required=True, help="the team's slug")
    register.add_argument("--uri", required=True, help="s3://bucket/prefix/ or a shared path")
    register.add_argument("--index", required=True, help="the dataset's index.json")
    register.set_defaults(run=cmd_dataset_register)
    sub.add_parser("datasets", help="your teams' datasets").set_defaults(run=cmd_datasets)
    lint = sub.add_parser(
        "nccl-lint", help="lint an NCCL environment block: exit 1 when any variable is an error"
    )
    lint.add_argument("file", help="export NAME=value, NAME=value or os.environ lines")
    lint.add_argument("--fabric", choices=["infiniband", "roce", "efa", "tcp"])
    lint.add_argument("--nccl-version", help="the nodes' NCCL, e.g. 2.21.5")
    lint.set_defaults(run=cmd_nccl_lint)
    _tuning_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.url, os.environ.get("CPCTL_TOKEN", ""))
    try:
        code = args.run(client, args)
    except ApiError as exc:
        print(f"cpctl: {exc}", file=sys.stderr)
        return 1
    except SpecFileError as exc:
        print(f"cpctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during --wait or --follow: the job goes on
        what = "tuning run" if args.command == "tuning" else "job"
        print(f"cpctl: interrupted (the {what} is not cancelled)", file=sys.stderr)
        return 130
    except (urllib.error.URLError, OSError) as exc:
        print(f"cpctl: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
