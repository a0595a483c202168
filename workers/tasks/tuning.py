"""NCCL tuning runs (apps/tuning/runs.py, apps/jobs/tuning_runs.py).

tuning.judge   when a tuning run's job has measured: the adoption rule, or the drift test
               and its bisection (apps/jobs/tuning_runs.py drift_followup)
tuning.sweep   every few minutes: judges runs whose judge task was lost, and starts the
               drift checks that are due (a pool's adopted settings re-measured weekly; a
               node marked slow and back from repair measured beside a good one)
"""

from celery import shared_task


@shared_task(
    name="tuning.judge", bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None
)
def judge(self, run_id: int) -> str:
    from apps.jobs.tuning_runs import drift_followup
    from apps.tuning.models import TuningRunState
    from apps.tuning.runs import tuning_run_judge

    run = tuning_run_judge(run_id)
    if run is not None and run.state == TuningRunState.JUDGING:
        # Its last output is still on the way: ask again (the judge stops waiting in time).
        raise self.retry(countdown=5)
    if run is None:
        return "not judging"
    return f"{run.state} {drift_followup(run.pk)}"


@shared_task(name="tuning.sweep", acks_late=True, reject_on_worker_lost=True)
def sweep() -> dict:
    from apps.jobs.tuning_runs import drift_checks_start, drift_followup, repaired_nodes_check
    from apps.tuning.runs import tuning_runs_redrive

    judged = tuning_runs_redrive()
    for run_id in judged:
        drift_followup(run_id)
    return {
        "judged": len(judged),
        "drift_checks": drift_checks_start(),
        "repaired_checks": repaired_nodes_check(),
    }
