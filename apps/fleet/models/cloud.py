"""Instances the orphan sweep found: ours by their tag, known to no node of the database."""

from django.db import models

from apps.fleet.models.pools import NodePool


class OrphanAction(models.TextChoices):
    REPORTED = "reported", "Reported"
    TERMINATED = "terminated", "Terminated"


class OrphanInstance(models.Model):
    """One instance carrying our control-plane tag whose node the database does not know.

    Written by the orphan sweep (workers/tasks/cloud.py): reported, or terminated when the
    pool its tags name says so. `gone_at` is set once a later sweep no longer finds it live.
    """

    instance_id = models.CharField(max_length=64, unique=True)
    region = models.CharField(max_length=30)
    node_uuid = models.CharField(
        max_length=64, blank=True, help_text="Its node tag; empty when it has none."
    )
    pool_tag = models.CharField(max_length=100, blank=True, help_text="Its pool tag, as found.")
    pool = models.ForeignKey(
        NodePool,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="orphan_instances",
        help_text="The pool its tag names, if it still exists.",
    )
    instance_type = models.CharField(max_length=50, blank=True)
    instance_state = models.CharField(max_length=20)
    launched_at = models.DateTimeField(null=True, blank=True)
    action = models.CharField(max_length=10, choices=OrphanAction.choices)
    first_seen_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    gone_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-last_seen_at", "instance_id"]
        indexes = [models.Index(fields=["region", "gone_at"])]

    def __str__(self) -> str:
        return self.instance_id
