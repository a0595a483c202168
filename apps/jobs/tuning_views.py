"""Pages of NCCL tuning runs: the list (with the form ops start one from) and a run's page
(its live progress, candidates and verdicts, bus-bandwidth charts, and ops' Adopt, Decline and
Cancel). Here, in the jobs app, because starting and cancelling a run make and stop its job
(apps/jobs/tuning_runs.py); the profiles' pages stay in apps/tuning."""

import math
import statistics

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.selectors import roles_of, teams_visible_to
from apps.jobs.forms import TuningRunForm
from apps.jobs.tuning_runs import tuning_run_cancel, tuning_run_start
from apps.tuning import adoption, runs, selectors
from apps.tuning.filtersets import TuningRunFilterSet
from apps.tuning.models import TuningRunKind, TuningRunState
from controlplane import charts
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response

S = TuningRunState
# Still changing without anyone's click: the run page asks for itself again while in these.
MOVING = (S.QUEUED, S.RUNNING, S.JUDGING)
BASELINE_COLOUR = "#111827"
CANDIDATE_COLOURS = charts.DISTINCT + charts.STACK_PALETTE[:-1]


def _is_ops(user) -> bool:
    return roles_of(user).manages_fleet


def _verdict_summary(run) -> str:
    """One line for the list: what was adopted, or why nothing was."""
    if run.adopted_version_id:
        return f"adopted as {run.adopted_version}"
    if run.result and run.result.get("reason"):
        return run.result["reason"]
    return "" if run.state in MOVING else run.state_reason


def _filtered(request):
    chosen = TuningRunFilterSet(request.GET, queryset=selectors.tuning_runs_for_listing())
    rows = chosen.qs if chosen.is_valid() else chosen.queryset.none()
    return chosen, rows


def _form(request, data=None) -> TuningRunForm:
    pools = [(p.slug, f"{p.name} ({p.fabric or 'fabric unknown'})") for p in selectors.pools_nccl()]
    teams = list(
        teams_visible_to(user=request.user).order_by("slug").values_list("slug", flat=True)
    )
    return TuningRunForm(data, pools=pools, teams=teams, initial={"pool": request.GET.get("pool")})


@login_required
def run_list(request):
    """The runs, newest first; for ops, the form that starts one (POST here: a refused plan is
    a 400 with the service's errors on the fields, and nothing written)."""
    ops = _is_ops(request.user)
    form, status = None, 200
    if request.method == "POST":
        if not ops:
            raise PermissionDenied("Only ops run NCCL tuning.")
        form = _form(request, request.POST)
        if form.is_valid():
            plan = form.to_plan()
            try:
                run = tuning_run_start(by=request.user, **plan)
            except ApplicationError as exc:
                form.add_service_errors(exc.details or {"__all__": [exc.message]})
            else:
                messages.success(request, f"Tuning run #{run.pk} queued on {plan['pool']}.")
                return redirect("tuning-runs:detail", run_id=run.pk)
        status = 400
    elif ops:
        form = _form(request)
    run_filter, rows = _filtered(request)
    return render(
        request,
        "tuning/runs.html",
        {
            "run_filter": run_filter,
            "rows": [(run, _verdict_summary(run)) for run in rows[:200]],
            "form": form,
            "states": S.choices,
            "kinds": TuningRunKind.choices,
        },
        status=status,
    )


RUN_CSV_COLUMNS = [
    ("id", lambda r: r.pk),
    ("kind", lambda r: r.kind),
    ("pool", lambda r: r.pool.slug),
    ("state", lambda r: r.state),
    ("launches_done", lambda r: r.launches_done),
    ("launches_total", lambda r: r.launches_total),
    ("candidates", lambda r: max(len(r.candidates) - 1, 0)),
    ("rounds", lambda r: r.rounds),
    ("nodes", lambda r: " ".join(r.node_names)),
    ("profile", lambda r: r.profile.name if r.profile else ""),
    ("verdict", _verdict_summary),
    ("started_by", lambda r: r.created_by.get_username() if r.created_by else "control plane"),
    ("created_at", lambda r: r.created_at.isoformat()),
    ("finished_at", lambda r: r.finished_at.isoformat() if r.finished_at else ""),
]


@login_required
def run_list_csv(request):
    _, rows = _filtered(request)
    return csv_response(
        "tuning-runs.csv",
        [name for name, _ in RUN_CSV_COLUMNS],
        ([value(run) for _, value in RUN_CSV_COLUMNS] for run in rows.iterator(chunk_size=500)),
    )


# --- a run's page -----------------------------------------------------------------------------


def _run(run_id: int):
    run = selectors.tuning_run_for_page(run_id=run_id)
    if run is None:
        raise Http404("No such tuning run.")
    return run


def _progress(run) -> dict:
    """N of M launches, and about how long the rest take at the pace so far."""
    done, total = run.launches_done, run.launches_total
    minutes_left = None
    if run.state == S.RUNNING and run.started_at and 0 < done < total:
        elapsed = (timezone.now() - run.started_at).total_seconds()
        minutes_left = max(1, math.ceil(elapsed / done * (total - done) / 60))
    return {
        "done": done,
        "total": total,
        "candidates": len(run.candidates),
        "rounds": run.rounds,
        "percent": round(100 * done / total) if total else 0,
        "minutes_left": minutes_left,
    }


def _size_tick(exponent: float) -> str:
    return adoption.size_label(2 ** int(exponent)) if float(exponent).is_integer() else ""


def _colour(index: int) -> str:
    return (
        BASELINE_COLOUR if index == 0 else CANDIDATE_COLOURS[(index - 1) % len(CANDIDATE_COLOURS)]
    )


def _charts(run, figures) -> list[dict]:
    """Per operation: bus bandwidth (median over rounds) against message size, a line per
    candidate and the baseline's drawn bold, on top. `points` is what is drawn, for tests and
    for a reader who wants the numbers."""
    drawn = []
    order = [c for c in run.candidates if c["index"] != 0] + run.candidates[:1]
    for op in run.ops:
        series, points = {}, {}
        for candidate in order:
            by_size = figures.get(candidate["index"], {}).get(op, {})
            medians = [(size, statistics.median(v)) for size, v in sorted(by_size.items()) if v]
            if medians:
                series[candidate["label"]] = [(math.log2(s), m) for s, m in medians]
                points[candidate["label"]] = medians
        if not series:
            continue
        drawn.append(
            {
                "op": op,
                "points": points,
                "svg": charts.line_chart(
                    series,
                    title=f"{op.replace('_', '-')}: bus bandwidth (GB/s, median) by message size",
                    x_format=_size_tick,
                    colours=[_colour(c["index"]) for c in order if c["label"] in series],
                    legend=False,
                    bold=("baseline",),
                    width=720,
                    height=260,
                ),
            }
        )
    return drawn


def _candidate_rows(run) -> list[dict]:
    result = run.result or {}
    verdicts, notes = result.get("verdicts", {}), result.get("not_judged", {})
    rows = []
    for candidate in run.candidates:
        verdict = verdicts.get(candidate["label"])
        chosen = result.get("chosen") == candidate["index"]
        rows.append(
            {
                **candidate,
                "swatch": charts.swatch(_colour(candidate["index"])),
                "verdict": verdict,
                "note": notes.get(candidate["label"], ""),
                "chosen": chosen,
                "adopted": chosen and run.state == S.ADOPTED,
            }
        )
    return rows


def _run_context(request, run) -> dict:
    figures = runs.figures(run)
    ops = _is_ops(request.user)
    actions = []
    if ops and run.state == S.AWAITING_APPROVAL:
        actions = ["adopt", "decline"]
    elif ops and run.state in (S.QUEUED, S.RUNNING) and run.job_id:
        actions = ["cancel"]
    return {
        "run": run,
        "live": run.state in MOVING,
        "progress": _progress(run),
        "candidate_rows": _candidate_rows(run),
        "charts": _charts(run, figures),
        "events": selectors.tuning_run_events(run=run),
        "actions": actions,
        "sizes": [adoption.size_label(s) for s in run.sizes],
        "sizes_that_matter": [adoption.size_label(s) for s in run.sizes_that_matter],
    }


@login_required
def run_detail(request, run_id: int):
    run = _run(run_id)
    return render(request, "tuning/run_detail.html", _run_context(request, run))


@login_required
def run_live(request, run_id: int):
    """The run page's live region, asked for every few seconds while the run still moves on
    its own (queued, running, judging); its answer for a run past those asks no more."""
    run = _run(run_id)
    return render(request, "tuning/_run_live.html", _run_context(request, run))


def _adopt(run, by, request):
    return runs.tuning_run_adopt(run=run, by=by)


def _decline(run, by, request):
    return runs.tuning_run_decline(run=run, by=by, reason=request.POST.get("reason", "")[:200])


def _cancel(run, by, request):
    return tuning_run_cancel(run=run, by=by)


OPERATIONS = {"adopt": _adopt, "decline": _decline, "cancel": _cancel}
DONE = {"adopt": "adopted", "decline": "declined", "cancel": "cancelled"}


@login_required
@require_POST
def run_operate(request, run_id: int, operation: str):
    """Adopt, Decline or Cancel, through the services; only ops."""
    if operation not in OPERATIONS:
        raise Http404("No such operation.")
    if not _is_ops(request.user):
        raise PermissionDenied("Only ops run NCCL tuning.")
    run = _run(run_id)
    try:
        OPERATIONS[operation](run, request.user, request)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Tuning run #{run.pk} {DONE[operation]}.")
    return redirect("tuning-runs:detail", run_id=run.pk)
