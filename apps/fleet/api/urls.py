from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.fleet.api import agent, views

router = SimpleRouter()
router.register("sites", views.SiteViewSet, basename="site")
router.register("racks", views.RackViewSet, basename="rack")
router.register("instance-types", views.InstanceTypeViewSet, basename="instance-type")
router.register("pools", views.NodePoolViewSet, basename="pool")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("node-events", views.NodeEventViewSet, basename="node-event")
router.register("gpus", views.GpuViewSet, basename="gpu")
router.register("orphan-instances", views.OrphanInstanceViewSet, basename="orphan-instance")

urlpatterns = router.urls

# What node agents call (node tokens, not API tokens): apps/fleet/api/agent.py.
urlpatterns += [
    path("agent/register", agent.register, name="agent-register"),
    path("agent/heartbeat", agent.heartbeat, name="agent-heartbeat"),
]
