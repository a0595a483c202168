"""API views for jobs, the queue, reservations and NCCL tuning runs."""

from django.http import QueryDict
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from apps.accounts.models import TokenScope
from apps.accounts.selectors import team_for_submission
from apps.jobs import datasets, selectors, services
from apps.jobs.api import serializers as s
from apps.jobs.filtersets import JobFilterSet, ReservationFilterSet
from apps.jobs.models import Job
from apps.jobs.models.jobs import FINISHED_STATES, jobs_note_last_pass
from apps.jobs.tuning_runs import tuning_run_cancel, tuning_run_start
from apps.tuning import runs as tuning
from apps.tuning import selectors as tuning_selectors
from apps.tuning.filtersets import TuningRunFilterSet
from controlplane.api import ServiceViewSet, reject_unstorable_text
from controlplane.errors import ApplicationError
from controlplane.exports import CsvRenderer, csv_errors_as_json, csv_response

IDEMPOTENCY_HEADER = OpenApiParameter(
    name="Idempotency-Key",
    location=OpenApiParameter.HEADER,
    required=False,
    type=str,
    description="A retried submit with the same key returns the first job instead of a second.",
)


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Jobs of your teams. Submit with POST; operate with the actions below."""

    filterset_class = JobFilterSet
    ordering_fields = ["submitted_at", "queued_at", "priority_class", "state"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    required_scope = TokenScope.SUBMIT

    def get_queryset(self):
        jobs = selectors.jobs_visible_to(user=self.request.user)
        if self.action == "retrieve":
            jobs = jobs.prefetch_related("events")
        return jobs.order_by("-submitted_at", "-id")

    def get_serializer_class(self):
        return s.JobDetailSerializer if self.action == "retrieve" else s.JobSerializer

    def get_renderers(self):
        if self.action == "evaluations":
            return [JSONRenderer(), CsvRenderer()]
        return super().get_renderers()

    def paginate_queryset(self, queryset):
        page = super().paginate_queryset(queryset)
        if page is not None:
            jobs_note_last_pass(page)  # one cache read for the page's reasons
        return page

    @extend_schema(
        request=s.JobSubmitSerializer,
        parameters=[IDEMPOTENCY_HEADER],
        responses={201: s.JobSerializer, 200: s.JobSerializer},
    )
    def create(self, request, *args, **kwargs):
        """Submit a job. 201 with the new job, or 200 with the first one for a reused key."""
        body = s.JobSubmitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        job, created = submit_request(
            user=request.user,
            spec=dict(body.validated_data),
            idempotency_key=request.headers.get("Idempotency-Key", ""),
        )
        answer = s.JobSerializer(job, context=self.get_serializer_context()).data
        return Response(answer, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def _operate(self, request, operation, **kwargs):
        job = operation(job=self.get_object(), by=request.user, **kwargs)
        return Response(s.JobSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(request=s.JobSubmitSerializer, responses=s.AdviceSerializer(many=True))
    @action(detail=False, methods=["post"])
    def estimate(self, request):
        """Before submitting: whether a trainer spec fits its GPUs on each layout its counts
        allow, the memory per GPU line by line, the run time and cost, and the suggested
        layout; one answer per GPU type it may land on. Nothing is submitted."""
        body = s.JobSubmitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        advice = estimate_request(user=request.user, spec=dict(body.validated_data))
        return Response([s.advice_data(a) for a in advice])

    @extend_schema(request=s.ReasonSerializer, responses=s.JobSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel: at once if it has not started; a running job checkpoints and stops."""
        body = s.ReasonSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        return self._operate(request, services.job_cancel, **body.validated_data)

    @extend_schema(request=None, responses=s.JobSerializer)
    @action(detail=True, methods=["post"])
    def hold(self, request, pk=None):
        """Keep a pending job out of scheduling until released."""
        return self._operate(request, services.job_hold)

    @extend_schema(request=None, responses=s.JobSerializer)
    @action(detail=True, methods=["post"])
    def release(self, request, pk=None):
        """Return a held job to the queue."""
        return self._operate(request, services.job_release)

    @extend_schema(request=s.ReasonSerializer, responses=s.JobSerializer)
    @action(detail=True, methods=["post"])
    def requeue(self, request, pk=None):
        """Queue it again: a finished job reruns; a running one checkpoints first."""
        body = s.ReasonSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        return self._operate(request, services.job_requeue, **body.validated_data)

    @extend_schema(
        parameters=[
            OpenApiParameter("after", int, description="Only lines after this line id."),
            OpenApiParameter("limit", int, description="At most this many lines (1000 at most)."),
            OpenApiParameter(
                "rank", int, description="Only the lines of this node rank (0 for the first node)."
            ),
            OpenApiParameter(
                "attempt",
                int,
                description="Only the lines of this attempt (1 for the first run; a requeued "
                "job's next run is 2, and so on).",
            ),
            OpenApiParameter(
                "q",
                str,
                description=f"Only the lines holding this text, in any case (at most "
                f"{selectors.LOG_SEARCH_MAX} characters).",
            ),
        ],
        responses=s.JobLogSerializer,
    )
    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        """The job's output, every rank's lines in arrival order, secrets masked; `rank`,
        `attempt` and `q` narrow it as the Job page's log viewer does.

        Follow it by asking again with `after` set to the answer's `next_after` (and the
        same filters).
        """
        job = self.get_object()
        query = s.LogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        wanted = {k: v for k, v in query.validated_data.items() if k != "format"}
        lines = selectors.job_log_lines(job=job, **wanted)
        answer = {
            "lines": lines,
            "next_after": lines[-1]["id"] if lines else query.validated_data.get("after", 0),
            "finished": job.state in FINISHED_STATES,
            "state": job.state,
        }
        return Response(s.JobLogSerializer(answer).data)

    @extend_schema(
        responses={
            (200, "application/json"): s.EvalMetricSerializer(many=True),
            (200, "text/csv"): OpenApiTypes.STR,
        }
    )
    @action(detail=True, methods=["get"], filter_backends=[], pagination_class=None)
    def evaluations(self, request, pk=None):
        """The job's held-out evaluations (trainer.eval): loss, perplexity and tokens evaluated
        at each step, each attempt's in step order. `format=csv`: the same rows."""
        job = self.get_object()
        rows = selectors.job_evaluations(job=job)
        if isinstance(request.accepted_renderer, CsvRenderer):
            return csv_response(
                f"job-{job.pk}-evaluations.csv",
                EVAL_COLUMNS,
                (
                    [e.attempt, e.step, e.loss, e.perplexity, e.tokens, e.at.isoformat()]
                    for e in rows
                ),
            )
        return Response(s.EvalMetricSerializer(rows, many=True).data)

    def finalize_response(self, request, response, *args, **kwargs):
        csv_errors_as_json(request, response)
        return super().finalize_response(request, response, *args, **kwargs)


EVAL_COLUMNS = ["attempt", "step", "loss", "perplexity", "tokens", "at"]


def submit_request(*, user, spec: dict, idempotency_key: str):
    """A submit request (its validated body and Idempotency-Key header) checked and queued:
    (job, created). Raises ApplicationError, before anything is written, for a request
    refused."""
    key = idempotency_key.strip()
    if len(key) > 200 or (key and not key.isprintable()):
        raise ApplicationError(
            "The Idempotency-Key header is too long or not printable.",
            details={"Idempotency-Key": ["At most 200 printable characters."]},
        )
    reject_unstorable_text(key)
    team = _team_visible(user, spec.pop("team"))
    return services.job_submit(
        team=team, spec=_jsonable(spec), submitted_by=user, idempotency_key=key
    )


def estimate_request(*, user, spec: dict) -> list:
    """An estimate request's validated body answered: the advisor's Advice per GPU type the
    job may land on (apps/jobs/advisor.py). Raises ApplicationError for a spec refused."""
    _team_visible(user, spec.pop("team"))
    return services.job_estimate(spec=_jsonable(spec))


def _team_visible(user, team_id: int):
    """The spec's team, if the user may see it; others answer as if they did not exist."""
    team = team_for_submission(user=user, team_id=team_id)
    if team is None:
        raise ApplicationError(
            "Invalid input: team.",
            details={"team": [f'Invalid pk "{team_id}" - object does not exist.']},
        )
    return team


def _jsonable(value):
    """Validated data holds Decimals; the stored spec is JSON."""
    from decimal import Decimal

    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, Decimal):
        return str(value)
    return value


class QueueView(generics.ListAPIView):
    """Every active job in queue order, a page at a time (`?page=N&page_size=M`), filtered by
    state and team; other teams' jobs are anonymous rows."""

    serializer_class = s.QueueRowSerializer
    filter_backends = []  # the queue's own filters, below: its order is not a queryset's

    @extend_schema(parameters=[s.QueueQuerySerializer])
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def list(self, request, *args, **kwargs):
        query = s.QueueQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        wanted = QueryDict(mutable=True)
        wanted.update(query.validated_data)
        jobs = JobFilterSet(wanted, queryset=Job.objects.all()).qs
        ids, position = selectors.queue_ids(jobs=jobs)
        page = self.paginate_queryset(ids)
        rows = selectors.queue_rows(page, user=request.user, position=position)
        return self.get_paginated_response(self.get_serializer(rows, many=True).data)


class ReservationViewSet(ServiceViewSet):
    http_method_names = ["get", "post", "delete", "head", "options"]
    serializer_class = s.ReservationSerializer
    filterset_class = ReservationFilterSet
    ordering_fields = ["starts_at", "ends_at"]
    create_service = services.reservation_create
    delete_service = services.reservation_delete
    instance_kwarg = "reservation"

    def get_queryset(self):
        return selectors.reservations_visible().order_by("starts_at", "id")

    def perform_create(self, serializer):
        data = dict(serializer.validated_data)
        data.setdefault("team", None)
        serializer.instance = services.reservation_create(by=self.request.user, **data)


class WebhookViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Webhooks called when a job of the team (or one job) ends. The signing key is shown once."""

    serializer_class = s.WebhookSerializer
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    # Where the team's job outcomes are sent is configuration, not job work: a submit
    # token (CI's) must not be able to redirect them.
    required_scope = TokenScope.ADMIN

    def get_queryset(self):
        return selectors.webhooks_visible_to(user=self.request.user).order_by("id")

    @extend_schema(request=s.WebhookSerializer, responses={201: s.WebhookCreatedSerializer})
    def create(self, request, *args, **kwargs):
        body = s.WebhookSerializer(data=request.data, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        hook, key = services.webhook_create(by=request.user, **body.validated_data)
        hook.signing_key = key
        answer = s.WebhookCreatedSerializer(hook, context=self.get_serializer_context()).data
        return Response(answer, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.webhook_delete(webhook=instance, by=self.request.user)


class DatasetViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Datasets of your teams (ops: every team's). POST registers one from its index.json
    (the team's admins and researchers); DELETE forgets it, refused (409) while a job that
    has not finished names it. `format=csv` on the list: one row per dataset."""

    serializer_class = s.DatasetSerializer
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    # CI that prepares data registers it, as it submits the jobs that read it.
    required_scope = TokenScope.SUBMIT

    def get_renderers(self):
        if self.action == "list":
            return [JSONRenderer(), CsvRenderer()]
        return super().get_renderers()

    def get_queryset(self):
        return datasets.datasets_visible_to(user=self.request.user).order_by("team__slug", "name")

    @extend_schema(
        responses={
            (200, "application/json"): s.DatasetSerializer(many=True),
            (200, "text/csv"): OpenApiTypes.STR,
        }
    )
    def list(self, request, *args, **kwargs):
        if not isinstance(request.accepted_renderer, CsvRenderer):
            return super().list(request, *args, **kwargs)
        rows = datasets.csv_rows(self.get_queryset())
        return csv_response("datasets.csv", datasets.CSV_COLUMNS, rows)

    def create(self, request, *args, **kwargs):
        body = s.DatasetSerializer(data=request.data, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        dataset = datasets.dataset_register(by=request.user, **body.validated_data)
        answer = s.DatasetSerializer(dataset, context=self.get_serializer_context()).data
        return Response(answer, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        datasets.dataset_delete(dataset=instance, by=self.request.user)


class TuningRunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """NCCL tuning runs: everyone signed in reads them (their figures choose the NCCL
    profiles every job gets); ops start, adopt, decline and cancel them. `format=csv` on the
    list: one row per run, every page."""

    filterset_class = TuningRunFilterSet
    ordering_fields = ["created_at", "finished_at"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_renderers(self):
        if self.action in ("list", "figures"):
            return [JSONRenderer(), CsvRenderer()]
        return super().get_renderers()

    def get_queryset(self):
        runs = tuning_selectors.tuning_runs_visible()
        if self.action == "retrieve":
            runs = runs.prefetch_related("events")
        return runs

    def get_serializer_class(self):
        return s.TuningRunDetailSerializer if self.action == "retrieve" else s.TuningRunSerializer

    @extend_schema(
        responses={
            (200, "application/json"): s.TuningRunSerializer(many=True),
            (200, "text/csv"): OpenApiTypes.STR,
        }
    )
    def list(self, request, *args, **kwargs):
        if not isinstance(request.accepted_renderer, CsvRenderer):
            return super().list(request, *args, **kwargs)
        runs = self.filter_queryset(self.get_queryset())
        return csv_response("tuning-runs.csv", TUNING_RUN_COLUMNS, _tuning_run_rows(runs))

    @extend_schema(request=s.TuningRunStartSerializer, responses={201: s.TuningRunDetailSerializer})
    def create(self, request, *args, **kwargs):
        """Start a tuning run on a pool (ops): 201 with the run, its job queued. A plan the
        linter or the rules refuse is a 400 naming each field (`candidates.NCCL_ALGO`)."""
        body = s.TuningRunStartSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        run = tuning_run_start(by=request.user, **body.validated_data)
        return self._answer(run, code=status.HTTP_201_CREATED)

    def _answer(self, run, code=status.HTTP_200_OK):
        run = self.get_queryset().prefetch_related("events").get(pk=run.pk)
        context = self.get_serializer_context()
        return Response(s.TuningRunDetailSerializer(run, context=context).data, status=code)

    @extend_schema(
        responses={
            (200, "application/json"): s.TuningFiguresSerializer,
            (200, "text/csv"): OpenApiTypes.STR,
        }
    )
    @action(detail=True, methods=["get"], filter_backends=[], pagination_class=None)
    def figures(self, request, pk=None):
        """Bus bandwidth per candidate, operation and message size: each round's figure and
        their median (what the adoption rule compares). `format=csv`: one row per figure."""
        run = self.get_object()
        if isinstance(request.accepted_renderer, CsvRenderer):
            labels = {c["index"]: c["label"] for c in run.candidates}
            return csv_response(
                f"tuning-run-{run.pk}.csv",
                FIGURE_COLUMNS,
                (
                    [
                        m.candidate,
                        labels.get(m.candidate, ""),
                        m.round,
                        m.op,
                        m.bytes,
                        m.busbw_gbps,
                        m.algbw_gbps,
                        m.time_us,
                        m.errors,
                    ]
                    for m in tuning_selectors.tuning_measurements_of(run=run)
                ),
            )
        answer = {
            "run": run.pk,
            "rounds": run.rounds,
            "figures": tuning_selectors.tuning_run_figures(run=run),
        }
        return Response(s.TuningFiguresSerializer(answer).data)

    @extend_schema(request=None, responses=s.TuningRunDetailSerializer)
    @action(detail=True, methods=["post"])
    def adopt(self, request, pk=None):
        """Approve what the adoption rule chose: the pool's profile gets it as a new version.
        409 unless the run awaits approval."""
        return self._answer(tuning.tuning_run_adopt(run=self.get_object(), by=request.user))

    @extend_schema(request=s.ReasonSerializer, responses=s.TuningRunDetailSerializer)
    @action(detail=True, methods=["post"])
    def decline(self, request, pk=None):
        """Keep the baseline: 409 unless the run awaits approval."""
        body = s.ReasonSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        run = tuning.tuning_run_decline(
            run=self.get_object(), by=request.user, **body.validated_data
        )
        return self._answer(run)

    @extend_schema(request=None, responses=s.TuningRunDetailSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel its job (queued or running runs only: 409 otherwise); the run follows."""
        return self._answer(tuning_run_cancel(run=self.get_object(), by=request.user))

    def finalize_response(self, request, response, *args, **kwargs):
        csv_errors_as_json(request, response)
        return super().finalize_response(request, response, *args, **kwargs)


TUNING_RUN_COLUMNS = [
    "id",
    "kind",
    "pool",
    "nodes",
    "state",
    "reason",
    "done",
    "total",
    "created_at",
    "started_at",
    "finished_at",
    "adopted_version",
]
FIGURE_COLUMNS = [
    "candidate",
    "label",
    "round",
    "op",
    "bytes",
    "busbw_gbps",
    "algbw_gbps",
    "time_us",
    "errors",
]


def _tuning_run_rows(runs):
    def when(at):
        return at.isoformat() if at else ""

    for run in runs.iterator(chunk_size=500):
        version = run.adopted_version
        yield [
            run.pk,
            run.kind,
            run.pool.slug,
            " ".join(run.node_names),
            run.state,
            run.state_reason,
            run.launches_done,
            run.launches_total,
            when(run.created_at),
            when(run.started_at),
            when(run.finished_at),
            f"{version.profile.name} v{version.number}" if version else "",
        ]
