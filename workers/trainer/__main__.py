"""`torchrun ... -m workers.trainer --config run.json`: train, and say why the run ended.

Exit 0 when the run finished or stopped on request (its checkpoint committed),
1 otherwise; either way the reason goes to CONTROLPLANE_STATUS_FILE (stopping.py).
"""

import argparse
import os
import sys
import traceback


def classify(error: BaseException) -> str:
    """code_error for the job's own failures; collective_timeout for stuck or broken collectives;
    storage for a checkpoint the disk could not take."""
    try:
        import torch.distributed as dist

        from workers.trainer.checkpoint import StorageError
    except ImportError:
        return "code_error"
    if isinstance(error, StorageError):
        return "storage"
    kinds = tuple(
        getattr(dist, name)
        for name in ("DistBackendError", "DistNetworkError")
        if hasattr(dist, name)
    )
    text = str(error).lower()
    if isinstance(error, kinds) or (
        isinstance(error, RuntimeError)
        and any(
            sign in text
            for sign in ("timed out", "timeout", "connection reset", "connection closed by peer")
        )
    ):
        return "collective_timeout"
    return "code_error"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="run.json (see workers/trainer/config.py)")
    args = parser.parse_args(argv)
    # Taken before anything here changes the environment (the flight recorder's renames).
    started_with = dict(os.environ)

    from workers.trainer.stopping import write_status

    rank = int(os.environ.get("RANK", "0"))
    progress = None
    try:
        from workers.trainer import config, metrics, train

        metrics.emit(metrics.environment_event(started_with))
        progress = train.Progress()
        outcome = train.run(config.load(args.config), progress)
    except BaseException as error:  # every failure must leave a reason behind
        traceback.print_exc()
        sys.stderr.flush()
        reason = classify(error)
        last_line = traceback.format_exception_only(type(error), error)[-1].strip()
        if reason == "storage":  # its message is written for people; the class adds nothing
            last_line = str(error)
        write_status(
            reason,
            step=progress.step if progress else 0,
            message=last_line,
            rank=rank,
        )
        return 1
    write_status(outcome.reason, step=outcome.step, rank=rank)
    return 0


if __name__ == "__main__":
    code = main()
    # Its status is written, its events printed, its checkpoints committed and its process
    # group destroyed: leave without the interpreter's teardown, in which a torch C++ thread
    # destroyed while still joinable aborted a rank that had ended well ("terminate called
    # without an active exception", SIGABRT, seen in a full test suite), turning a finished
    # or preempted run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
