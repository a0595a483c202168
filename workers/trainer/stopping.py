"""How a run ends: the stop signal, the exit reason for the control plane, a stuck-step watchdog.

torchrun turns any worker failure into exit code 1, so each worker also writes
why it stopped to the file named by CONTROLPLANE_STATUS_FILE, as JSON:
{"reason", "step", "message", "rank", "time"}. Reasons: "finished",
"preempted" (a stop signal; a checkpoint was committed first), "code_error"
(the job's own failure: the message is the traceback's last line) and
"collective_timeout" (a collective never completed or a peer went away: the
infrastructure's failure) and "storage" (the checkpoint directory could not
take a save: also the infrastructure's). The workers of one node share the
file; a more telling reason is never overwritten by a less telling one
(code_error beats storage, which beats collective_timeout, which beats
preempted and finished), so the rank whose
code failed names the cause even when its peers fail after it.
"""

import fcntl
import json
import os
import signal
import threading
import time
from pathlib import Path

STATUS_FILE_VARIABLE = "CONTROLPLANE_STATUS_FILE"
RANKING = {"finished": 0, "preempted": 1, "collective_timeout": 2, "storage": 3, "code_error": 4}


class StopSignal:
    """SIGTERM (the agent's stop or spot notice) or SIGINT asks for a checkpoint and an exit.

    The handler only sets a flag; the training loop votes it at each step
    boundary and reads the ranks' vote a step later, so they all stop after the
    same step: the one after the vote.
    """

    def __init__(self):
        self.received: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None


def write_status(reason: str, *, step: int, message: str = "", rank: int = 0) -> None:
    """Record the exit reason where the agent looks for it, unless a weightier one is there."""
    path = os.environ.get(STATUS_FILE_VARIABLE)
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = json.loads(path.read_text())
        except (OSError, ValueError):
            current = None
        if current and RANKING.get(current.get("reason"), 0) > RANKING[reason]:
            return
        record = {
            "reason": reason,
            "step": step,
            "message": message[-2000:],
            "rank": rank,
            "time": time.time(),
        }
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(record))
        temporary.replace(path)


class StepWatchdog:
    """Ends a process whose step has not finished within the collective timeout.

    A collective that never completes (a peer lost, a network partition) hangs
    the step; NCCL's own watchdog would abort the process without a word, and
    the control plane would read that as the job's failure. This thread fires
    first, writes "collective_timeout", and exits. It arms after the first
    step, so compilation and the first collectives' set-up are not timed.
    """

    def __init__(self, timeout_s: float, *, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self.step = 0
        self._beat: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step = step
        self._beat = time.monotonic()

    def pause(self) -> None:
        """Stop timing (a checkpoint being written, the end of the run)."""
        self._beat = None

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(self.timeout_s / 10, 5.0)):
            beat = self._beat
            if beat is not None and time.monotonic() - beat > self.timeout_s:
                message = (
                    f"step {self.step + 1} did not finish in {self.timeout_s:.0f} s: "
                    "a collective is stuck or a peer is gone"
                )
                print(f"[rank {self.rank}] {message}", flush=True)
                write_status("collective_timeout", step=self.step, message=message, rank=self.rank)
                os._exit(1)
