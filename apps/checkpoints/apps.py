from django.apps import AppConfig


class CheckpointsConfig(AppConfig):
    name = "apps.checkpoints"
    label = "checkpoints"
    verbose_name = "Checkpoints"

    def ready(self):
        # A job's detail (the API's jobs/{id}/) shows its checkpoints' summary; jobs sit
        # below checkpoints and cannot import it, so checkpoints hands the summary in.
        from apps.checkpoints.selectors import job_checkpoint_summary
        from apps.jobs.extensions import job_detail_part_register

        job_detail_part_register("checkpoints", job_checkpoint_summary)
