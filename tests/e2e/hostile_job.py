"""What a hostile job tries on its node, run as a job's own code (`python3 -c`, its text read
by the tests): reach another job, its node's agent or the control plane.

argv: the control plane's URL, then JSON of what to aim at: {"victim_pid_marker",
"victim_dirs": [...], "control_plane_files": [...], "secret": "..."}. It prints one
JSON line, `{"hostile": {attempt: "refused" | "READ ...", ...}}`: anything not refused
is a hole. Standard library only: the node's python3 may be a bare one.
"""

import json
import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

url, aims = sys.argv[1], json.loads(sys.argv[2])
me = os.getuid()
results: dict[str, str] = {}


def attempt(name: str, action) -> None:
    try:
        got = action()
    except (OSError, ValueError) as exc:
        results[name] = f"refused ({type(exc).__name__})"
        return
    results[name] = "READ " + repr(got)[:200]


def other_users_processes() -> list[int]:
    """Processes running as someone else (their status is world-readable; their
    environment must not be)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(next(x for x in status.splitlines() if x.startswith("Uid:")).split()[1])
        if uid != me:
            pids.append(int(entry))
    return pids


# 1. Every other user's process environment: other jobs' secrets, the agent's, the
#    control plane's DATABASE_URL and SECRET_KEY.
readable = []
others = other_users_processes()
results["other users' processes seen"] = f"{len(others)}"
for pid in others:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        continue
    if data:
        readable.append(pid)
results["other processes' environments"] = "READ " + str(readable) if readable else "refused"

# 2. The node's agent: its settings (the node token) and its log, found from our status file.
node_dir = Path(os.environ["CONTROLPLANE_STATUS_FILE"]).parents[2]
attempt("agent.env", lambda: (node_dir / "agent.env").read_text())
attempt("agent.log", lambda: (node_dir / "agent.log").read_text()[-200:])
attempt("list the node directory", lambda: os.listdir(node_dir))
attempt("list the runs", lambda: os.listdir(node_dir / "runs"))

# 3. Other runs' directories, by guessing their numbers.
mine = int(os.environ["CONTROLPLANE_RUN_ID"])
opened = []
for run_id in range(max(1, mine - 50), mine + 50):
    if run_id == mine:
        continue
    for name in ("", "run.json", "status.json"):
        path = node_dir / "runs" / f"run-{run_id}" / name
        try:
            os.listdir(path) if not name else path.read_bytes()
            opened.append(str(path))
        except OSError:
            pass
results["other runs' files"] = "READ " + str(opened) if opened else "refused"

# 4. The victim's own directories (its checkpoints), and the control plane's files.
for path in aims.get("victim_dirs", []):
    attempt(f"list {path}", lambda path=path: os.listdir(path))
for path in aims.get("control_plane_files", []):
    attempt(f"read {path}", lambda path=path: Path(path).read_text())

# 5. The agent API, without the node's token (we could not read it) and with our own guess.
for token in ("", "cpn_guess"):
    request = urllib.request.Request(url + "/api/v1/agent/runs/")  # noqa: S310
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
            results[f"agent API ({token or 'no token'})"] = "READ " + answer.read()[:200].decode()
    except urllib.error.HTTPError as exc:
        results[f"agent API ({token or 'no token'})"] = f"refused ({exc.code})"
    except OSError as exc:
        results[f"agent API ({token or 'no token'})"] = f"refused ({exc})"


# 6. Signal the victim (found by its command line, which /proc shows to everyone).
def signal_victim() -> int:
    marker = aims["victim_pid_marker"].encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                    os.kill(int(entry), signal.SIGKILL)
                    return int(entry)
            except PermissionError:
                raise
            except OSError:
                continue
    return -1


attempt("kill the victim", signal_victim)

print(json.dumps({"hostile": results}), flush=True)
