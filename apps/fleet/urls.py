from django.urls import path

from apps.fleet import views

app_name = "fleet"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("nodes.csv", views.nodes_csv, name="nodes-csv"),
]
