"""Pages: the Queue, the History (finished jobs), the Submit form (with the layouts that
fit), and each Job's page."""

import datetime as dt
import hashlib
import itertools
import json
from decimal import Decimal
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.selectors import roles_of, team_ids_by_slug, teams_visible_to
from apps.jobs import datasets, selectors, services, specs
from apps.jobs.api.serializers import JobSubmitSerializer
from apps.jobs.api.views import estimate_request, submit_request
from apps.jobs.filtersets import JobFilterSet
from apps.jobs.forms import CUSTOM_MODEL, MODEL_SIZES, NOT_ESTIMATED, SubmitForm
from apps.jobs.models import Job, Placement
from apps.jobs.models.jobs import FINISHED_STATES, JOB_GPU_TYPES
from controlplane import charts
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response
from workers.trainer.config import tp_allowed
from workers.trainer.presets import PRESETS, ModelShape

QUEUE_PAGE_SIZE = 100
QUEUE_COLUMNS = [
    "position",
    "id",
    "team",
    "name",
    "state",
    "priority",
    "gpus",
    "gpu_type",
    "nodes",
    "reason",
    "estimated_start",
    "started_at",
    "elapsed_s",
    "submitted_at",
]


def _filters(request) -> dict[str, str]:
    """The filters' chosen values, for the page to show them."""
    return {"state": request.GET.get("state", ""), "team": request.GET.get("team", "")}


def _filtered(request, jobs: QuerySet[Job]) -> QuerySet[Job]:
    """These jobs through JobFilterSet with the page's filters; a value it refuses (a state
    there is none of) matches nothing."""
    chosen = JobFilterSet(request.GET, queryset=jobs)
    return chosen.qs if chosen.is_valid() else jobs.none()


def _queue_context(request) -> dict:
    """The Queue's table and counts, for the page and for its live region alike."""
    filters = _filters(request)
    # A page at a time: a queue of 50,000 jobs is not one page (the CSV has every row).
    page = selectors.queue_page(
        user=request.user,
        jobs=_filtered(request, Job.objects.all()),
        page=request.GET.get("page"),
        per_page=QUEUE_PAGE_SIZE,
    )
    rows = page.object_list
    team_ids = team_ids_by_slug(slugs={r["team"] for r in rows})
    for row in rows:
        row["can_cancel"] = not row["anonymous"] and services.job_can_manage(
            user=request.user,
            team_id=team_ids.get(row["team"], -1),
            submitted_by_id=row.get("submitted_by_id"),
        )
    query = request.GET.copy()
    query.pop("page", None)
    # The live region asks with the page's own query (filters and page), and a Cancel
    # inside it comes back to the page, not to the fragment.
    here = request.GET.urlencode()
    return {
        "rows": rows,
        "page": page,
        "querystring": query.urlencode(),
        "page_query": here,
        "page_path": reverse("jobs:queue") + (f"?{here}" if here else ""),
        "filters": filters,
    }


@login_required
def queue(request):
    states, teams = selectors.queue_choices()
    return render(
        request,
        "jobs/queue.html",
        {**_queue_context(request), "states": states, "teams": teams},
    )


@login_required
def queue_live(request):
    """The Queue's live region: its table, pages and count, asked for again every few
    seconds with the page's filters and page."""
    return render(request, "jobs/_queue_live.html", {**_queue_context(request), "live": True})


HISTORY_PAGE_SIZE = 50
HISTORY_COLUMNS = [
    "id",
    "team",
    "name",
    "state",
    "state_reason",
    "gpus",
    "gpu_type",
    "nodes",
    "submitted_by",
    "submitted_at",
    "started_at",
    "finished_at",
    "ran_s",
]
HISTORY_CSV_BATCH = 2000  # rows whose nodes are read in one query


def _history(request) -> QuerySet:
    """The History's rows: the user's finished jobs, through the page's filters."""
    return selectors.job_history(
        jobs=_filtered(request, selectors.jobs_visible_to(user=request.user))
    )


@login_required
def history(request):
    filters = _filters(request)
    page = Paginator(_history(request), HISTORY_PAGE_SIZE)
    page = page.get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    rows = [selectors.history_row(row) for row in page.object_list]
    nodes = selectors.nodes_ran_on(job_ids=[row["id"] for row in rows])
    for row in rows:
        row["nodes"] = nodes.get(row["id"], [])
    return render(
        request,
        "jobs/history.html",
        {
            "rows": rows,
            "page": page,
            "querystring": query.urlencode(),
            "states": sorted(FINISHED_STATES),
            "teams": teams_visible_to(user=request.user)
            .order_by("slug")
            .values_list("slug", flat=True),
            "filters": filters,
            "compare_most": COMPARED_MAX,
        },
    )


ESTIMATES_COLUMNS = [
    "id",
    "team",
    "name",
    "state",
    "gpu_type",
    "gpus",
    "layout",
    "peak_memory_gib_predicted",
    "peak_memory_gib_measured",
    "peak_memory_error_pct",
    "step_time_s_predicted",
    "step_time_s_measured",
    "step_time_error_pct",
    "cost_predicted",
    "cost_measured",
    "cost_error_pct",
    "finished_at",
]
ESTIMATES_CSV_BATCH = 500  # jobs whose steps and costs are read in one go


def _estimated_jobs(request) -> QuerySet[Job]:
    """The estimates page's jobs: the user's finished trainer jobs with an estimate, through
    the page's filters, the latest to finish first."""
    return selectors.finished_jobs_with_estimates(
        jobs=_filtered(request, selectors.jobs_visible_to(user=request.user))
    )


@login_required
def estimates(request):
    """How right the advisor was: for recent finished trainer jobs, predicted peak memory per
    GPU, step time and cost beside what was measured, and the error of each."""
    truths = selectors.estimates_beside_truth(
        jobs=list(_estimated_jobs(request)[: selectors.ESTIMATES_RECENT])
    )
    return render(
        request,
        "jobs/estimates.html",
        {
            "truths": truths,
            "summary": selectors.estimate_errors_summary(truths),
            "recent": selectors.ESTIMATES_RECENT,
            "states": sorted(FINISHED_STATES),
            "teams": teams_visible_to(user=request.user)
            .order_by("slug")
            .values_list("slug", flat=True),
            "filters": _filters(request),
        },
    )


def _estimates_csv_rows(jobs):
    def number(value, places: int):
        return "" if value is None else round(value, places)

    jobs = iter(jobs)
    while batch := list(itertools.islice(jobs, ESTIMATES_CSV_BATCH)):
        for truth in selectors.estimates_beside_truth(jobs=batch):
            job = truth.job
            line = [
                job.pk,
                job.team.slug,
                job.name,
                job.state,
                truth.gpu_type,
                job.gpus,
                job.estimate.get("layout", ""),
            ]
            for compared, places in (
                (truth.peak_memory_gib, 2),
                (truth.step_time_s, 4),
                (truth.cost, 2),
            ):
                line += [
                    number(compared.predicted, places),
                    number(compared.measured, places),
                    number(compared.error_pct, 1),
                ]
            yield [*line, job.finished_at or ""]


@login_required
def estimates_csv(request):
    return csv_response(
        "estimates.csv",
        ESTIMATES_COLUMNS,
        _estimates_csv_rows(_estimated_jobs(request).iterator(chunk_size=ESTIMATES_CSV_BATCH)),
    )


@login_required
def dataset_list(request):
    """The datasets of your teams (ops: all): where each lives, its tokenizer and sizes."""
    rows = datasets.datasets_visible_to(user=request.user).order_by("team__slug", "name")
    return render(request, "jobs/datasets.html", {"datasets": rows})


@login_required
def dataset_list_csv(request):
    rows = datasets.datasets_visible_to(user=request.user).order_by("team__slug", "name")
    return csv_response("datasets.csv", datasets.CSV_COLUMNS, datasets.csv_rows(rows))


COMPARED_MAX = len(charts.DISTINCT)  # jobs on one compare page, each its own colour


@login_required
def compare(request):
    """Jobs compared: their loss and tokens/s curves by step, overlaid (`?job=1&job=2`, as
    the History's ticks send them). Jobs the user may not see are left out, as if unknown."""
    wanted = []
    for value in request.GET.getlist("job"):
        job_id = _whole_number(value)
        if job_id is not None and job_id not in wanted:
            wanted.append(job_id)
    too_many = len(wanted) > COMPARED_MAX
    wanted = wanted[:COMPARED_MAX]
    found = {
        job.pk: job
        for job in selectors.jobs_visible_to(user=request.user)
        .filter(pk__in=wanted)
        .select_related("team")
    }
    jobs = [found[job_id] for job_id in wanted if job_id in found]
    series = selectors.jobs_compared_series(job_ids=[job.pk for job in jobs])
    colours = charts.DISTINCT
    rows = []
    for i, job in enumerate(jobs):
        drawn = series[job.pk]
        tokens = [value for _, value in drawn["tokens_per_s"]]
        rows.append(
            {
                "job": job,
                "label": f"#{job.pk} {job.name}",
                "swatch": charts.swatch(colours[i]),
                "steps": drawn["steps"],
                "loss": drawn["loss"][-1][1] if drawn["loss"] else None,
                "tokens_per_s": sum(tokens) / len(tokens) if tokens else None,
            }
        )

    def chart(key: str, title: str):
        return charts.line_chart(
            {row["label"]: series[row["job"].pk][key] for row in rows},
            title=title,
            colours=colours,
            legend=False,
            width=720,
            height=260,
        )

    return render(
        request,
        "jobs/compare.html",
        {
            "rows": rows,
            "charts": [chart("loss", "Loss"), chart("tokens_per_s", "Tokens per second")]
            if rows
            else [],
            "unknown": len(wanted) - len(jobs),
            "too_many": too_many,
            "most": COMPARED_MAX,
        },
    )


def _history_csv_rows(rows):
    """The History's CSV lines, with where each job ran, its nodes read a batch at a time."""
    rows = iter(rows)
    while batch := list(itertools.islice(rows, HISTORY_CSV_BATCH)):
        nodes = selectors.nodes_ran_on(job_ids=[row["id"] for row in batch])
        for row in map(selectors.history_row, batch):
            yield [
                row["id"],
                row["team__slug"],
                row["name"],
                row["state"],
                row["state_reason"],
                row["gpus"],
                row["gpu_type"],
                " ".join(nodes.get(row["id"], ())),
                row["submitted_by__username"] or "",
                row["submitted_at"],
                row["started_at"] or "",
                row["finished_at"] or "",
                "" if row["ran"] is None else round(row["ran"].total_seconds()),
            ]


@login_required
def history_csv(request):
    return csv_response("history.csv", HISTORY_COLUMNS, _history_csv_rows(_history(request)))


@login_required
def queue_csv(request):
    rows = selectors.queue_for(user=request.user, jobs=_filtered(request, Job.objects.all()))
    now = timezone.now()
    for row in rows:
        row["nodes"] = " ".join(row["nodes"])
        if row["started_at"]:
            row["elapsed_s"] = round((now - row["started_at"]).total_seconds())
    return csv_response(
        "queue.csv",
        QUEUE_COLUMNS,
        ([row.get(c) for c in QUEUE_COLUMNS] for row in rows),
    )


@login_required
def submit(request):
    """The API's submit road (its serializer, then its service) for the form's spec."""
    form = SubmitForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        body = JobSubmitSerializer(data=form.to_spec())
        if not body.is_valid():
            form.add_spec_errors(body.errors)
        else:
            try:
                job, _ = submit_request(
                    user=request.user, spec=dict(body.validated_data), idempotency_key=""
                )
            except ApplicationError as exc:
                form.add_spec_errors(exc.details or {"__all__": [exc.message]})
            else:
                messages.success(request, f"Job {job.pk} submitted.")
                return redirect("jobs:detail", job_id=job.pk)
    layouts, problem = _layouts_for(request.POST or request.GET)
    return render(
        request,
        "jobs/submit.html",
        {"form": form, "layouts": layouts, "layouts_problem": problem},
        status=400 if problem else 200,
    )


def _gpu_counts(params) -> tuple[int, int]:
    """The form's GPUs and GPUs per node, as its htmx parts send them; ValueError, saying
    why, when they are not whole numbers within a job's limits."""
    try:
        gpus = int(params.get("gpus") or 8)
        per_node = min(int(params.get("gpus_per_node") or 8), gpus)
    except ValueError:
        raise ValueError("Give whole numbers of GPUs.") from None
    if not 1 <= gpus <= specs.MAX_GPUS or not 1 <= per_node <= specs.MAX_GPUS_PER_NODE:
        raise ValueError(specs.COUNTS_LIMIT)
    return gpus, per_node


def _layouts_for(params) -> tuple[list[specs.Layout], str]:
    """(the layouts that fit, and that the precision takes, "") or ([], why the counts are
    refused)."""
    shape = _model_shape(params)
    try:
        gpus, per_node = _gpu_counts(params)
        if shape is None or gpus % per_node:
            return [], ""
        precision = params.get("precision") or "bf16"
        layouts = specs.valid_layouts(shape, nodes=gpus // per_node, gpus_per_node=per_node)
        return [one for one in layouts if tp_allowed(one.tp, precision=precision)], ""
    except ValueError as refused:
        return [], str(refused)


def _model_shape(params) -> ModelShape | None:
    """The form's model: its preset, or its explicit sizes once they are all whole numbers
    (the layouts depend on its layers, heads and KV heads alone)."""
    preset = params.get("preset") or "tiny"
    if preset != CUSTOM_MODEL:
        return PRESETS.get(preset)
    sizes = {}
    for field, key in MODEL_SIZES.items():
        value = (params.get(field) or "").strip()
        if key != "max_seq_len":
            if not value.isdigit() or int(value) < 1:
                return None
            sizes[key] = int(value)
    return ModelShape(**sizes)


@login_required
def outlook(request):
    """What the job on the Submit form would meet if submitted now (the form asks with
    htmx as its fields change): room in the pools, the team's quota, the jobs ahead, the
    cost of its time limit."""
    params = request.GET
    context = {"problem": "", "outlook": None}
    try:
        gpus, per_node = _gpu_counts(params)
        hours = Decimal(params.get("time_limit_hours") or "4")
        if not hours.is_finite():
            raise ValueError(hours)
    except (ValueError, ArithmeticError):
        context["problem"] = (
            f"Give whole numbers of GPUs and a time limit in hours. {specs.COUNTS_LIMIT}"
        )
        return render(request, "jobs/_outlook.html", context)
    gpu_type = params.get("gpu_type") or "H100"
    where = params.get("placement") or Placement.OWNED_THEN_CLOUD
    if (
        gpus % per_node
        or not 0 < hours <= 720
        or gpu_type not in dict(JOB_GPU_TYPES)
        or where not in Placement.values
    ):
        context["problem"] = "The outlook shows once the resources above are valid."
        return render(request, "jobs/_outlook.html", context)
    # Quota figures only for a team the user submits for (the form's own choices).
    try:
        team_id = int(params.get("team") or "")
    except ValueError:
        team_id = None
    if team_id is not None and not roles_of(request.user).can_submit_for(team_id):
        team_id = None
    context["gpu_type"] = gpu_type
    context["outlook"] = selectors.submission_outlook(
        team_id=team_id,
        gpu_type=gpu_type,
        nodes=gpus // per_node,
        gpus_per_node=per_node,
        priority=params.get("priority") or "normal",
        where=where,
        spot=params.get("spot") == "on",
        time_limit_s=int(hours * 3600),
    )
    return render(request, "jobs/_outlook.html", context)


@login_required
def layouts(request):
    """The layout <select> for the chosen preset and GPU count (the form asks with htmx)."""
    layouts, problem = _layouts_for(request.GET)
    return render(
        request,
        "jobs/_layouts.html",
        {"layouts": layouts, "layouts_problem": problem, "selected": request.GET.get("layout", "")},
        status=400 if problem else 200,
    )


@login_required
def advice(request):
    """For a trainer job on the Submit form (it asks with htmx as its fields change): each
    layout its GPU counts allow, whether it fits the GPUs' memory, line by line, its run
    time and cost, and the layout to take; the same answer as POST /api/v1/jobs/estimate/."""
    form = SubmitForm(request.GET, user=request.user)
    context = {"problem": "", "advice": []}
    if (request.GET.get("kind") or "trainer") != "trainer":
        context["problem"] = (
            "Estimates are for the bundled trainer: a command's memory and speed are its own."
        )
        return render(request, "jobs/_advice.html", context)
    spec = form.estimate_spec()
    body = JobSubmitSerializer(data=spec) if spec is not None else None
    if body is None or not body.is_valid():
        if body is not None:
            form.add_spec_errors(body.errors)
        context["problem"] = _first_problem(form) or (
            "The estimate shows once the fields above are valid."
        )
        return render(request, "jobs/_advice.html", context)
    try:
        found = estimate_request(user=request.user, spec=dict(body.validated_data))
    except ApplicationError as exc:
        form.add_spec_errors(exc.details or {"__all__": [exc.message]})
        context["problem"] = _first_problem(form) or exc.message
    else:
        context["advice"] = [_advice_shown(a) for a in found]
    return render(request, "jobs/_advice.html", context)


def _first_problem(form: SubmitForm) -> str:
    """The first error on a field the estimate rests on, named by its field's label."""
    for name, problems in form.errors.items():
        if name not in NOT_ESTIMATED:
            label = form.fields[name].label or name.replace("_", " ") if name in form.fields else ""
            return f"{label.capitalize()}: {problems[0]}" if label else problems[0]
    return ""


MEMORY_BAR_PX = 160


def _advice_shown(advice) -> dict:
    """One GPU type's advice as the Submit page draws it: per layout, its memory as a bar of
    its lines (one scale for every row, the GPU's memory marked) and its figures."""
    scale = max(
        [advice.layouts[0].gpu_memory_gib if advice.layouts else 1.0]
        + [a.estimate.total / 2**30 for a in advice.layouts]
    )
    rows = []
    for one in advice.layouts:
        lines = one.estimate.as_dict()["lines"]
        segments, x = [], 0.0
        for name in lines:  # the memory model's order: parameters first, runtime last
            width = lines[name] / scale * MEMORY_BAR_PX
            segments.append(
                {"line": name, "gib": lines[name], "x": round(x, 1), "width": round(width, 1)}
            )
            x += width
        rows.append(
            {
                "advice": one,
                "label": one.layout.label,
                "value": one.layout.value,
                "lines": list(lines.items()),
                "segments": segments,
                "limit_x": round(one.gpu_memory_gib / scale * MEMORY_BAR_PX, 1),
                "run_time": (
                    None if one.run_time_s is None else selectors.short_duration(one.run_time_s)
                ),
                "within": one.within(advice.time_limit_s),
                "suggested": one is advice.suggested,
                "chosen": one is advice.chosen,
            }
        )
    return {
        "gpu_type": advice.gpu_type,
        "gpus": advice.gpus,
        "gpu_memory_gib": advice.layouts[0].gpu_memory_gib if advice.layouts else None,
        "time_limit": selectors.short_duration(advice.time_limit_s),
        "rows": rows,
        "chosen": advice.chosen,
        "suggested": advice.suggested,
        "basis": advice.basis,
        "bar_px": MEMORY_BAR_PX,
    }


def _job_for_page(request, job_id: int) -> Job:
    """The job, if the user may see it (404 otherwise), with what its head shows."""
    return get_object_or_404(
        selectors.jobs_visible_to(user=request.user).select_related(
            "team", "submitted_by", "pool", "wait"
        ),
        pk=job_id,
    )


def _live_context(request, job: Job) -> dict:
    """What the Job page's live parts show (its head, timeline and runs)."""
    runs = selectors.job_runs(job=job)
    return {
        "job": job,
        "runs": runs,
        "attempt_runs": [run for run in runs if run.attempt == runs[0].attempt],
        "attempt_nodes": selectors.attempt_nodes(runs),
        "events": list(job.events.all()),
        "finished": job.state in FINISHED_STATES,
        "actions": services.job_actions(state=job.state),
        "can_manage": services.job_can_manage(
            user=request.user, team_id=job.team_id, submitted_by_id=job.submitted_by_id
        ),
    }


@login_required
def detail(request, job_id: int):
    job = _job_for_page(request, job_id)
    live = _live_context(request, job)
    return render(
        request,
        "jobs/detail.html",
        {
            **live,
            "nccl_environments": selectors.job_nccl_environments(job=job),
            "rank_environments": selectors.job_rank_environments(job=job),
            "cost": selectors.job_cost(job=job),
            "truth": next(iter(selectors.estimates_beside_truth(jobs=[job])), None),
            **_training_context(job),
            **_log_context(
                request, job, attempts_ranks=[(r.attempt, r.node_rank) for r in live["runs"]]
            ),
            "spec_json": json.dumps(
                {k: v for k, v in job.spec.items() if k != "fingerprint"},
                indent=2,
                sort_keys=True,
            ),
        },
    )


@login_required
def live(request, job_id: int):
    """The Job page's head (state, reason, actions, nodes), with its timeline and runs out of
    band: asked every few seconds while the job is not finished."""
    job = _job_for_page(request, job_id)
    return render(request, "jobs/_live.html", _live_context(request, job))


def _training_context(job) -> dict:
    series = selectors.job_training_series(job=job)

    def percent(value: float) -> str:
        return f"{value * 100:.0f}%"

    evaluations = selectors.job_eval_series(job=job)
    if not series["latest"]:
        return {"latest": None, "charts": [], "mfu_reported": False, "evaluations": []}
    loss = dict(series["loss"])
    if evaluations:
        # Drawn last, so on top and in the strongest colour, with a dot per evaluation.
        loss[EVAL_SERIES] = [(e.step, e.loss) for e in evaluations]
    drawn = [
        charts.line_chart(
            loss,
            title="Loss (training, and held-out: eval)",
            bold=(EVAL_SERIES,),
            marked={EVAL_SERIES: [_eval_title(e) for e in evaluations]},
        ),
        charts.line_chart(series["tokens_per_s"], title="Tokens per second"),
    ]
    # Steps without MFU are steps on CPU (no peak FLOPs to divide by): say so, rather than
    # draw an empty chart that waits for data that will never come.
    if series["mfu"]:
        drawn.append(
            charts.line_chart(series["mfu"], title="Model FLOPs utilisation", y_format=percent)
        )
    return {
        "latest": series["latest"],
        "charts": drawn,
        "mfu_reported": bool(series["mfu"]),
        # The table under the charts: the newest evaluations first.
        "evaluations": evaluations[::-1][:EVAL_ROWS],
        "eval_rows": EVAL_ROWS,
    }


EVAL_SERIES = "eval"
EVAL_ROWS = 10


def _eval_title(evaluation) -> str:
    perplexity = "—" if evaluation.perplexity is None else f"{evaluation.perplexity:.4g}"
    return (
        f"eval at step {evaluation.step} (attempt {evaluation.attempt}): "
        f"loss {evaluation.loss:.4f}, perplexity {perplexity}"
    )


@login_required
def training(request, job_id: int):
    """The Job page's training panel (curves and the newest step); asks again while active."""
    job = get_object_or_404(selectors.jobs_visible_to(user=request.user), pk=job_id)
    return render(
        request,
        "jobs/_training.html",
        {"job": job, "finished": job.state in FINISHED_STATES, **_training_context(job)},
    )


LOG_LINES = 200  # the viewer opens with the newest lines, and takes at most this many a poll
# Agents relay output apart from the exit: the viewer keeps asking this long after the end.
LOG_LATE_S = 20


def _whole_number(value: str | None) -> int | None:
    try:
        number = int(value or "")
    except ValueError:
        return None
    return number if 0 <= number < 2**31 else None


def _log_context(request, job: Job, *, attempts_ranks: list | None = None) -> dict:
    """The log viewer's lines through its filters (node rank, attempt, search), the choices
    for its filters when the runs' (attempt, node rank) are given, and the query its next
    poll asks with."""
    params = request.GET
    filters = {
        "rank": _whole_number(params.get("rank")),
        "attempt": _whole_number(params.get("attempt")),
        "text": (params.get("q") or "").strip()[: selectors.LOG_SEARCH_MAX],
    }
    after = _whole_number(params.get("after"))
    # One more than shown: when it comes, lines between `after` and these were left out.
    lines = selectors.job_log_tail(job=job, limit=LOG_LINES + 1, after=after or 0, **filters)
    skipped = len(lines) > LOG_LINES
    lines = lines[-LOG_LINES:]
    last = lines[-1]["id"] if lines else (after or 0)
    finished = job.state in FINISHED_STATES
    late = finished and job.finished_at and timezone.now() - job.finished_at < _LATE
    poll = {k: filters[k] for k in ("rank", "attempt") if filters[k] is not None}
    if filters["text"]:
        poll["q"] = filters["text"]
    context = {
        "job": job,
        "log_lines": lines,
        "log_skipped": skipped and after is not None,
        "log_filters": filters,
        # Names the view these filters make: new lines are added to it alone.
        "log_view": "v"
        + hashlib.blake2s(repr(sorted(filters.items())).encode(), digest_size=6).hexdigest(),
        "log_filtered": any(v not in (None, "") for v in filters.values()),
        "log_following": not finished or bool(late),
        "log_poll_query": urlencode({**poll, "after": last}),
        "log_prefix": job.nodes > 1 or job.restarts > 0,
        "log_limit": LOG_LINES,
        "finished": finished,
    }
    if attempts_ranks is not None:
        context["log_ranks"] = sorted({rank for _, rank in attempts_ranks})
        context["log_attempts"] = sorted({attempt for attempt, _ in attempts_ranks}, reverse=True)
    return context


_LATE = dt.timedelta(seconds=LOG_LATE_S)


@login_required
def log_tail(request, job_id: int):
    """The Job page's log viewer. Asked with `after` (the newest line it shows) by its poll
    while the job is active: the lines after it, appended to the viewer (out of band) and the
    poll again. Asked without: the whole viewer, through its filters."""
    job = get_object_or_404(selectors.jobs_visible_to(user=request.user), pk=job_id)
    if "after" in request.GET:
        return render(request, "jobs/_log_new.html", _log_context(request, job))
    return render(
        request,
        "jobs/_log_tail.html",
        _log_context(request, job, attempts_ranks=selectors.job_attempts_ranks(job=job)),
    )


@login_required
def log_download(request, job_id: int):
    """Every stored line of the job as plain text, streamed (a long log is never held whole):
    the same lines as `cpctl logs`, each with its time, attempt and node rank."""
    job = get_object_or_404(selectors.jobs_visible_to(user=request.user), pk=job_id)

    def text():
        for line in selectors.job_log_every_line(job=job):
            stream = "" if line["stream"] == "stdout" else f" {line['stream']}"
            yield (
                f"{line['at']:%Y-%m-%dT%H:%M:%S.%fZ} [attempt {line['attempt']} "
                f"rank {line['rank']}{stream}] {line['text']}\n"
            )

    response = StreamingHttpResponse(text(), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}.log"'
    return response


OPERATIONS = {
    "cancel": services.job_cancel,
    "hold": services.job_hold,
    "release": services.job_release,
    "requeue": services.job_requeue,
}


@login_required
@require_POST
def operate(request, job_id: int, operation: str):
    job = get_object_or_404(selectors.jobs_visible_to(user=request.user), pk=job_id)
    if operation not in OPERATIONS:
        raise Http404("No such operation.")
    try:
        OPERATIONS[operation](job=job, by=request.user)
        messages.success(request, f"Job {job.pk}: {operation} done.")
    except ApplicationError as exc:
        messages.error(request, exc.message)
    back = request.POST.get("next", "")
    if back.startswith("/") and not back.startswith("//"):  # only our own pages
        return redirect(back)
    return redirect("jobs:detail", job_id=job.pk)
