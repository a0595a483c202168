from django.urls import path

from apps.checkpoints import views

app_name = "checkpoints"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("checkpoints.csv", views.jobs_csv, name="csv"),
    path("live/", views.overview_live, name="overview-live"),
    path("jobs/<int:job_id>/", views.job_panel, name="job-panel"),
    path("<int:checkpoint_id>/export/", views.export, name="export"),
]
