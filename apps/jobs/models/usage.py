"""Each team's decayed GPU usage, the input of fair share (Slurm's decayed usage)."""

import datetime as dt

from django.db import models

# Usage is stored scaled to this moment, so decay needs no write: the stored value
# times 2^-((now - epoch) / half-life) is the usage now. Only teams that held GPUs
# since the last pass are written, however many teams there are.
USAGE_EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class TeamUsage(models.Model):
    """GPU-seconds halved every FAIR_SHARE_HALF_LIFE_S, stored scaled to USAGE_EPOCH."""

    team = models.OneToOneField("accounts.Team", on_delete=models.CASCADE, related_name="usage")
    scaled_gpu_seconds = models.FloatField(default=0.0)
    updated_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.team_id}: {self.scaled_gpu_seconds:.3g} scaled GPU-seconds"
