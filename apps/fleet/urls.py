from django.urls import path

from apps.fleet import views

app_name = "fleet"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("live/", views.overview_live, name="live"),
    path("nodes.csv", views.nodes_csv, name="nodes-csv"),
    path("nodes/<str:key>/", views.node_detail, name="node"),
    path("nodes/<str:key>/live/", views.node_live, name="node-live"),
    path("nodes/<str:key>/<str:action>/", views.node_operate, name="node-operate"),
]
