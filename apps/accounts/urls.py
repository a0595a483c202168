from django.urls import path

from apps.accounts import views

app_name = "accounts"
urlpatterns = [
    path("", views.tokens, name="tokens"),
    path("tokens.csv", views.tokens_csv, name="tokens-csv"),
    path("<int:token_id>/revoke/", views.token_revoke, name="token-revoke"),
]
