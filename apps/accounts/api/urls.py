from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.accounts.api import views

router = SimpleRouter()
router.register("teams", views.TeamViewSet, basename="team")
router.register("team-quotas", views.TeamQuotaViewSet, basename="team-quota")
router.register("memberships", views.MembershipViewSet, basename="membership")
router.register("service-accounts", views.ServiceAccountViewSet, basename="service-account")
router.register("tokens", views.ApiTokenViewSet, basename="token")
router.register("audit-events", views.AuditEventViewSet, basename="audit-event")
router.register("team-secrets", views.TeamSecretViewSet, basename="team-secret")

urlpatterns = [path("me/", views.MeView.as_view(), name="me"), *router.urls]
