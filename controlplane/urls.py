"""URLs: pages, the REST API under /api/v1/, its schema and docs, health and metrics."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from apps.accounts import views as accounts_views
from controlplane import agent_bundle, observability

# Django tries these in order, each app's routes in turn: the jobs API (CI's submissions
# and polls) goes first.
api_v1 = [
    path("", include("apps.jobs.api.urls")),
    path("", include("apps.accounts.api.urls")),
    path("", include("apps.fleet.api.urls")),
    path("", include("apps.tuning.api.urls")),
    path("", include("apps.costs.api.urls")),
    path("", include("apps.checkpoints.api.urls")),
]

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="fleet:overview", permanent=False)),
    path("login/", accounts_views.SignInView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("fleet/", include("apps.fleet.urls")),
    path("jobs/", include("apps.jobs.urls")),
    # Tuning runs' pages are the jobs app's (a run is a job); the profiles' are tuning's.
    path("nccl/tuning/", include("apps.jobs.tuning_urls")),
    path("nccl/", include("apps.tuning.urls")),
    path("costs/", include("apps.costs.urls")),
    path("checkpoints/", include("apps.checkpoints.urls")),
    path("tokens/", include("apps.accounts.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # Swagger UI's start-up script from its own URL, not inline, so the page keeps the
    # Content-Security-Policy (controlplane/csp.py).
    path(
        "api/docs/",
        SpectacularSwaggerSplitView.as_view(url_name="api-schema", template_name="api_docs.html"),
        name="api-docs",
    ),
    # Cloud nodes' user data downloads the agent from here (workers/providers/aws.py's
    # AGENT_BUNDLE_PATH): code only, no secrets, so no authentication.
    path("agent/bundle.tar.gz", agent_bundle.download, name="agent-bundle"),
    path("healthz", observability.healthz, name="healthz"),
    path("metrics", observability.metrics, name="metrics"),
]

handler404 = "controlplane.views.not_found"
handler500 = "controlplane.views.server_error"
