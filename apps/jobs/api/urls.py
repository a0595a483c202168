from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.jobs.api import views

router = SimpleRouter()
router.register("jobs", views.JobViewSet, basename="job")
router.register("reservations", views.ReservationViewSet, basename="reservation")
router.register("webhooks", views.WebhookViewSet, basename="webhook")

urlpatterns = [path("queue/", views.QueueView.as_view(), name="queue"), *router.urls]
