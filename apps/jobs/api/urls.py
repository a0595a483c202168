from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.jobs.api import agent, views

router = SimpleRouter()
router.register("jobs", views.JobViewSet, basename="job")
router.register("reservations", views.ReservationViewSet, basename="reservation")
router.register("webhooks", views.WebhookViewSet, basename="webhook")
router.register("datasets", views.DatasetViewSet, basename="dataset")
router.register("tuning-runs", views.TuningRunViewSet, basename="tuning-run")

urlpatterns = [path("queue/", views.QueueView.as_view(), name="queue"), *router.urls]

# What node agents call (node tokens): apps/jobs/api/agent.py.
urlpatterns += [
    path("agent/runs/", agent.work, name="agent-work"),
    path("agent/runs/<int:run_id>/status", agent.run_status, name="agent-run-status"),
    path("agent/runs/<int:run_id>/logs", agent.run_logs, name="agent-run-logs"),
    path("agent/events", agent.events, name="agent-events"),
]
