from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "apps.accounts"
    label = "accounts"
    verbose_name = "Accounts and teams"

    def ready(self):
        from apps.accounts import (
            schema,  # noqa: F401  (registers the OpenAPI auth extensions)
            signals,
        )

        signals.connect()
