from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "apps.jobs"
    label = "jobs"
    verbose_name = "Jobs and the queue"

    def ready(self):
        # The fleet's node page and heat map show which job holds each GPU; the fleet sits
        # below jobs and cannot import it, so jobs hands the look-up in.
        from apps.fleet.extensions import gpu_holders_register
        from apps.jobs.selectors import gpu_holders

        gpu_holders_register(gpu_holders)
