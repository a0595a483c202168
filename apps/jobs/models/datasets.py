"""Datasets: a team's tokenised training data, where it lives and what its index says."""

from django.conf import settings
from django.db import models


class Dataset(models.Model):
    """A directory of token shards with an `index.json` (workers/trainer/prepare.py), on a
    shared path or under an S3 prefix. Job specs name it; dispatch stages it onto the nodes."""

    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="datasets")
    name = models.SlugField(max_length=100)
    uri = models.CharField(
        max_length=1000, help_text="s3://bucket/prefix/ or an absolute shared path."
    )
    tokenizer_name = models.CharField(max_length=200, blank=True)
    tokenizer_sha256 = models.CharField(max_length=64, blank=True)
    vocab_size = models.PositiveIntegerField()
    shards = models.PositiveIntegerField()
    tokens = models.PositiveBigIntegerField()
    bytes = models.PositiveBigIntegerField()
    documents = models.PositiveBigIntegerField()
    index = models.JSONField(help_text="The dataset's index.json, as registered.")
    index_sha256 = models.CharField(max_length=64, help_text="Keys the nodes' staged copies.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="dataset_name_unique_per_team")
        ]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.name}"

    @property
    def on_s3(self) -> bool:
        return self.uri.startswith("s3://")
