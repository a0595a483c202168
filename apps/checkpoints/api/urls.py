from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.checkpoints.api import agent, views

router = SimpleRouter()
router.register("checkpoints", views.CheckpointViewSet, basename="checkpoint")
router.register("checkpoint-copies", views.CheckpointCopyViewSet, basename="checkpoint-copy")
router.register("checkpoint-jobs", views.JobCheckpointsViewSet, basename="checkpoint-job")
router.register(
    "checkpoint-s3-destinations", views.S3DestinationViewSet, basename="checkpoint-s3-destination"
)

urlpatterns = [
    path("checkpoint-storage/", views.StorageView.as_view(), name="checkpoint-storage"),
    *router.urls,
]

# What node agents call (node tokens): apps/checkpoints/api/agent.py.
urlpatterns += [
    path("agent/checkpoints/events", agent.events, name="agent-checkpoint-events"),
    path("agent/checkpoints/work", agent.work, name="agent-checkpoint-work"),
    path(
        "agent/checkpoints/copies/<int:copy_id>/verification",
        agent.verification,
        name="agent-checkpoint-verification",
    ),
    path(
        "agent/checkpoints/copies/<int:copy_id>/deletion",
        agent.deletion,
        name="agent-checkpoint-deletion",
    ),
    path("agent/checkpoints/sweeps/<int:sweep_id>", agent.sweep, name="agent-checkpoint-sweep"),
    path(
        "agent/checkpoints/exports/<int:export_id>",
        agent.export,
        name="agent-checkpoint-export",
    ),
]
