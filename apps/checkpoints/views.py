"""Pages: the Checkpoints page (every trainer job the user may see, storage per team, CSV) and
the checkpoint panel of each Job page, which the Job page loads with htmx (jobs sit below
checkpoints, so the Job page's view cannot import the registry), with its "Export to Hugging
Face" buttons."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.selectors import teams_visible_to
from apps.checkpoints import selectors, services
from apps.checkpoints.filtersets import JobCheckpointsFilterSet, overdue_only
from apps.checkpoints.models import CheckpointState
from apps.jobs.models import JobState
from apps.jobs.models.jobs import FINISHED_STATES
from apps.jobs.selectors import jobs_visible_to
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response
from controlplane.selects import options_html

PAGE_SIZE = 50


def _rows(request, jobs) -> list[selectors.JobCheckpoints]:
    return selectors.job_rows(list(jobs), overdue_only=overdue_only(request.GET))


def _filtered(request):
    found = JobCheckpointsFilterSet(
        request.GET, queryset=selectors.trainer_jobs_visible_to(user=request.user)
    )
    return found, (found.qs if found.is_valid() else found.queryset.none())


def _overview_context(request) -> dict:
    """The Checkpoints page's tables and counts, for the page and its live region alike."""
    found, jobs = _filtered(request)
    if overdue_only(request.GET):
        # Overdue needs each job's step times: picked from every running job the filters
        # leave (a few hundred at most), then paged, so a page is never short of them.
        page = Paginator(_rows(request, jobs), PAGE_SIZE).get_page(request.GET.get("page"))
        rows = page.object_list
    else:
        page = Paginator(jobs, PAGE_SIZE).get_page(request.GET.get("page"))
        rows = selectors.job_rows(list(page.object_list))
    query = request.GET.copy()
    query.pop("page", None)
    # The teams whose rows get an export button (roles are read once per request).
    exportable = {
        row.job.team_id
        for row in rows
        if services.checkpoint_export_allowed(user=request.user, team_id=row.job.team_id)
    }
    return {
        "filter": found,
        "rows": rows,
        "exportable": exportable,
        "page": page,
        "querystring": query.urlencode(),
        # The live region asks with the page's own query: its filters and its page.
        "page_query": request.GET.urlencode(),
        "storage": selectors.storage_by_team(user=request.user),
        "now": timezone.now(),
    }


@login_required
def overview(request):
    context = _overview_context(request)
    teams = teams_visible_to(user=request.user).order_by("slug").values_list("pk", "slug")
    return render(
        request,
        "checkpoints/overview.html",
        {
            **context,
            "team_options": options_html(teams, context["filter"].data.get("team_id")),
            "job_states": JobState.choices,
            "checkpoint_states": CheckpointState.choices,
        },
    )


@login_required
def overview_live(request):
    """The Checkpoints page's live region: its jobs table and pages, with its count and the
    storage per team (out of band), asked for again with the page's filters and page."""
    return render(
        request, "checkpoints/_overview_live.html", {**_overview_context(request), "live": True}
    )


CSV_COLUMNS = [
    "job_id",
    "job",
    "team",
    "job_state",
    "newest_step",
    "newest_state",
    "newest_committed_at",
    "newest_age_s",
    "newest_copies",
    "verified_step",
    "verified_committed_at",
    "best_step",
    "best_eval_loss",
    "checkpoints",
    "size_bytes",
    "overdue",
    "watch",
]


def _csv_row(row: selectors.JobCheckpoints, now) -> list:
    newest, verified = row.newest, row.newest_verified
    copies = (
        " ".join(f"{c.kind}:{c.state}" for c in newest.copies.all() if c.state != "deleted")
        if newest
        else ""
    )
    return [
        row.job.pk,
        row.job.name,
        row.job.team.slug,
        row.job.state,
        newest.step if newest else "",
        newest.state if newest else "",
        newest.committed_at.isoformat() if newest else "",
        round((now - newest.committed_at).total_seconds()) if newest else "",
        copies,
        verified.step if verified else "",
        verified.committed_at.isoformat() if verified else "",
        row.best.step if row.best else "",
        row.best.eval_loss if row.best else "",
        row.live_count,
        row.size_bytes,
        "yes" if row.watch.overdue else "no",
        row.watch.reason,
    ]


@login_required
def jobs_csv(request):
    """The page's table as CSV, with its filters, every page of it."""
    _, jobs = _filtered(request)
    now = timezone.now()
    rows = []
    for start in range(0, jobs.count(), 500):
        rows += [_csv_row(row, now) for row in _rows(request, jobs[start : start + 500])]
    return csv_response("checkpoints.csv", CSV_COLUMNS, rows)


@login_required
def job_panel(request, job_id: int):
    """A Job page's checkpoint list; while the job is active the panel asks again (htmx)."""
    job = get_object_or_404(jobs_visible_to(user=request.user), pk=job_id)
    (row,) = selectors.job_rows([job])
    checkpoints = selectors.job_checkpoints(job=job)
    exporting = any(e.state == "requested" for c in checkpoints for e in c.exports.all())
    return render(
        request,
        "checkpoints/_job_panel.html",
        {
            "job": job,
            "row": row,
            "checkpoints": checkpoints,
            "best": selectors.best_of(checkpoints),
            "retention": selectors.retention_policy(job),
            # A finished job's panel asks again while an export is under way.
            "finished": job.state in FINISHED_STATES and not exporting,
            "may_export": services.checkpoint_export_allowed(
                user=request.user, team_id=job.team_id
            ),
            "now": timezone.now(),
        },
    )


@login_required
@require_POST
def export(request, checkpoint_id: int):
    """The panel's "Export to Hugging Face" button; back to the Job page with what happened."""
    checkpoint = get_object_or_404(
        selectors.checkpoints_visible_to(user=request.user), pk=checkpoint_id
    )
    try:
        done = services.checkpoint_export_request(
            checkpoint=checkpoint, by=request.user, dtype=request.POST.get("dtype") or "bfloat16"
        )
        messages.success(request, f"Step {checkpoint.step}: export to {done.path} asked.")
    except ApplicationError as exc:
        messages.error(request, exc.message)
    return redirect("jobs:detail", job_id=checkpoint.job_id)
