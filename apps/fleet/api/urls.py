from rest_framework.routers import SimpleRouter

from apps.fleet.api import views

router = SimpleRouter()
router.register("sites", views.SiteViewSet, basename="site")
router.register("racks", views.RackViewSet, basename="rack")
router.register("instance-types", views.InstanceTypeViewSet, basename="instance-type")
router.register("pools", views.NodePoolViewSet, basename="pool")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("node-events", views.NodeEventViewSet, basename="node-event")
router.register("gpus", views.GpuViewSet, basename="gpu")

urlpatterns = router.urls
