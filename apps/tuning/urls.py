from django.urls import path

from apps.tuning import views

app_name = "tuning"
urlpatterns = [
    path("profiles/", views.profiles, name="profiles"),
    path("profiles.csv", views.profiles_csv, name="profiles-csv"),
    path("profiles/new/", views.profile_edit, name="profile-new"),
    path("profiles/<slug:name>/", views.profile_detail, name="profile"),
    path("profiles/<slug:name>/edit/", views.profile_edit, name="profile-edit"),
    path("profiles/<slug:name>/delete/", views.profile_delete, name="profile-delete"),
    path(
        "profiles/<slug:name>/versions/<int:number>/restore/",
        views.profile_version_restore,
        name="profile-version-restore",
    ),
    path("lint/", views.lint, name="lint"),
    path("variables/", views.variables, name="variables"),
]
