"""Each team's decayed GPU usage, the input of fair share (Slurm's decayed usage)."""

from django.db import models


class TeamUsage(models.Model):
    """GPU-seconds with an exponential decay: halved every FAIR_SHARE_HALF_LIFE_S.

    Each scheduling pass decays the stored value to now and adds the GPUs the
    team held since the last pass, so reading it costs one row per team.
    """

    team = models.OneToOneField("accounts.Team", on_delete=models.CASCADE, related_name="usage")
    gpu_seconds = models.FloatField(default=0.0)
    updated_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.team_id}: {self.gpu_seconds:.0f} decayed GPU-seconds"
