from django.apps import AppConfig


class TuningConfig(AppConfig):
    name = "apps.tuning"
    label = "tuning"
    verbose_name = "NCCL settings"
