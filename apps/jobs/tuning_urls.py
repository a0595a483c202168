"""URLs of the tuning runs' pages, mounted under /nccl/tuning/ beside the NCCL profiles."""

from django.urls import path

from apps.jobs import tuning_views as views

app_name = "tuning-runs"
urlpatterns = [
    path("", views.run_list, name="list"),
    path("runs.csv", views.run_list_csv, name="list-csv"),
    path("<int:run_id>/", views.run_detail, name="detail"),
    path("<int:run_id>/live/", views.run_live, name="live"),
    path("<int:run_id>/<str:operation>/", views.run_operate, name="operate"),
]
