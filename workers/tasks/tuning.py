"""NCCL tuning runs (apps/tuning/runs.py, apps/jobs/tuning_runs.py).

tuning.judge   when a tuning run's job has measured: the adoption rule, or the drift test
tuning.sweep   every few minutes: judges runs whose judge task was lost, and starts the
               drift checks that are due (a pool's adopted settings re-measured weekly)
"""

from celery import shared_task


@shared_task(name="tuning.judge", acks_late=True, reject_on_worker_lost=True)
def judge(run_id: int) -> str:
    from apps.tuning.runs import tuning_run_judge

    run = tuning_run_judge(run_id)
    return run.state if run is not None else "not judging"


@shared_task(name="tuning.sweep", acks_late=True, reject_on_worker_lost=True)
def sweep() -> dict:
    from apps.jobs.tuning_runs import drift_checks_start
    from apps.tuning.runs import tuning_runs_redrive

    return {"judged": tuning_runs_redrive(), "drift_checks": drift_checks_start()}
