from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.tuning.api import views

router = SimpleRouter()
router.register("nccl-profiles", views.NcclProfileViewSet, basename="nccl-profile")

urlpatterns = [
    path("nccl-lint/", views.NcclLintView.as_view(), name="nccl-lint"),
    path("nccl-variables/", views.NcclVariablesView.as_view(), name="nccl-variables"),
    *router.urls,
]
