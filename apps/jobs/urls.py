from django.urls import path

from apps.jobs import views

app_name = "jobs"
urlpatterns = [
    path("", views.queue, name="queue"),
    path("queue.csv", views.queue_csv, name="queue-csv"),
    path("queue/live/", views.queue_live, name="queue-live"),
    path("history/", views.history, name="history"),
    path("history.csv", views.history_csv, name="history-csv"),
    path("compare/", views.compare, name="compare"),
    path("estimates/", views.estimates, name="estimates"),
    path("datasets/", views.dataset_list, name="datasets"),
    path("datasets.csv", views.dataset_list_csv, name="datasets-csv"),
    path("estimates.csv", views.estimates_csv, name="estimates-csv"),
    path("submit/", views.submit, name="submit"),
    path("submit/layouts/", views.layouts, name="layouts"),
    path("submit/outlook/", views.outlook, name="outlook"),
    path("submit/advice/", views.advice, name="advice"),
    path("<int:job_id>/", views.detail, name="detail"),
    path("<int:job_id>/live/", views.live, name="live"),
    path("<int:job_id>/log-tail/", views.log_tail, name="log-tail"),
    path("<int:job_id>/log.txt", views.log_download, name="log-download"),
    path("<int:job_id>/training/", views.training, name="training"),
    path("<int:job_id>/<str:operation>/", views.operate, name="operate"),
]
