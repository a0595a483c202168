"""`cpctl tuning` and `cpctl nccl` against the live server, as ops (or CI) would run them: a run
started and followed to its verdicts (measured here without a GPU, as in test_runs.py),
adopted, shown and listed; a profile's versions listed and one restored."""

import datetime as dt
import os
import subprocess
import sys
import time

import pytest
from django.db import transaction
from django.utils import timezone

from apps.tuning import runs
from apps.tuning.models import NcclProfile, NcclProfileVersion, TuningRun
from apps.tuning.services import nccl_profile_create, nccl_profile_update
from tests.apps.tuning.test_runs import measured, report
from tests.controlplane.test_cli import cpctl, token_of

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


START = ["--team", "alpha", "--rounds", "5", "--candidate", "NCCL_MIN_NCHANNELS=4", "--wait"]
START += ["--poll", "0.2"]


def _run_started(timeout_s=30.0) -> TuningRun:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = TuningRun.objects.first()
        if run is not None:
            return run
        time.sleep(0.1)
    raise AssertionError("no tuning run was started")


def _until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "cpctl printed nothing new"
        time.sleep(0.1)


def test_start_wait_follows_progress_to_the_verdicts_then_ops_adopt(
    live_server, ib_pool, ops_user, researcher, team, tmp_path
):
    token = token_of(ops_user)
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token}
    printed = tmp_path / "out.txt"
    with printed.open("w") as out:
        waiting = subprocess.Popen(
            [sys.executable, "-m", "cpctl", "tuning", "start", ib_pool.slug, *START],
            env=env,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
        run = _run_started()
        assert [c["changes"] for c in run.candidates if c["origin"] == "ops"] == [
            {"NCCL_MIN_NCHANNELS": "4"}
        ]
        total = run.launches_total
        with transaction.atomic():
            runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
        runs.tuning_events_record(
            job_id=run.job_id, events=[{"event": "tuning_launch", "done": total // 2}], head=True
        )
        # Half the launches in 10 minutes: about 10 minutes left.
        TuningRun.objects.filter(pk=run.pk).update(
            started_at=timezone.now() - dt.timedelta(minutes=10)
        )
        _until(lambda: "launches" in printed.read_text())
        with transaction.atomic():
            report(run, {2: 1.3})
            measured(run)
        _, err = waiting.communicate(timeout=60)
    out = printed.read_text()
    assert waiting.returncode == 0, (out, err)
    assert f"tuning run {run.pk} queued on {ib_pool.slug}" in out
    assert f"{total // 2}/{total} launches, about 10 min left" in out
    chosen = run.candidates[2]["label"]
    assert f"tuning run {run.pk} awaiting:" in out and f"{chosen}: faster" in out
    assert f"cpctl tuning adopt {run.pk}" in out

    refused = cpctl(live_server, token_of(researcher), "tuning", "adopt", str(run.pk))
    assert refused.returncode == 1 and "Only ops run NCCL tuning." in refused.stderr
    adopted = cpctl(live_server, token, "tuning", "adopt", str(run.pk))
    assert adopted.returncode == 0, adopted.stderr
    tuned = NcclProfile.objects.get(pool=ib_pool)
    assert f"adopted as {tuned.name} v1" in adopted.stdout
    again = cpctl(live_server, token, "tuning", "decline", str(run.pk))
    assert again.returncode == 1 and "cannot become declined" in again.stderr

    shown = cpctl(live_server, token, "tuning", "show", str(run.pk))
    assert shown.returncode == 0, shown.stderr
    assert f"{total}/{total} launches" in shown.stdout  # every launch reported by now
    assert "[0] baseline (baseline): —" in shown.stdout and "NCCL_MIN_NCHANNELS=4" in shown.stdout
    listed = cpctl(live_server, token, "tuning", "list", "--state", "adopted")
    assert listed.returncode == 0, listed.stderr
    (row,) = listed.stdout.splitlines()[1:]
    assert row.split()[:4] == [str(run.pk), "tuning", ib_pool.slug, "adopted"]
    versions = cpctl(live_server, token, "nccl", "versions", tuned.name)
    assert versions.returncode == 0, versions.stderr
    (row,) = versions.stdout.splitlines()[1:]
    assert row.split()[:3] == ["1", "yes", "adopted"] and str(run.pk) in row


def test_nccl_versions_and_restore(live_server, ops_user, researcher):
    # Its own profile: a transactional test may have flushed the built-in ones.
    profile = nccl_profile_create(
        by=ops_user, name="cli-ib", title="CLI", fabric="infiniband", env={"NCCL_DEBUG": "WARN"}
    )
    nccl_profile_update(profile=profile, by=ops_user, env={"NCCL_DEBUG": "INFO"})
    token = token_of(ops_user)
    listed = cpctl(
        live_server, token_of(researcher, scopes=("read",)), "nccl", "versions", "cli-ib"
    )
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()[1:]] == [
        ["2", "yes"],
        ["1", "created"],
    ]
    denied = cpctl(live_server, token_of(researcher), "nccl", "restore", "cli-ib", "1")
    assert denied.returncode == 1
    restored = cpctl(live_server, token, "nccl", "restore", "cli-ib", "1")
    assert restored.returncode == 0, restored.stderr
    assert "cli-ib is now version 3 (version 1's)" in restored.stdout
    latest = NcclProfileVersion.objects.get(profile=profile, number=3)
    assert latest.env == NcclProfileVersion.objects.get(profile=profile, number=1).env
    current = cpctl(live_server, token, "nccl", "restore", "cli-ib", "3")
    assert current.returncode == 1 and "current version" in current.stderr
