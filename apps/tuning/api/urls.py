from django.urls import path, re_path
from rest_framework.routers import SimpleRouter

from apps.tuning.api import views

router = SimpleRouter()
router.register("nccl-profiles", views.NcclProfileViewSet, basename="nccl-profile")

urlpatterns = [
    path("nccl-lint/", views.NcclLintView.as_view(), name="nccl-lint"),
    path("nccl-variables/", views.NcclVariablesView.as_view(), name="nccl-variables"),
    path(
        "nccl-profiles/<slug:name>/versions/",
        views.NcclProfileVersionsView.as_view(),
        name="nccl-profile-versions",
    ),
    re_path(
        r"^nccl-profiles/(?P<name>[-a-zA-Z0-9_]+)/versions/(?P<number>[0-9]{1,9})/restore/$",
        views.NcclProfileVersionRestoreView.as_view(),
        name="nccl-profile-version-restore",
    ),
    *router.urls,
]
