"""The shape every state-change record shares (a node's, a job's): when, from what state
to what, why, and who."""

from django.conf import settings
from django.db import models


class StateChange(models.Model):
    """One state change: append-only. A subclass adds what changed (its foreign key), its
    states as choices on from_state and to_state, its order and its actor index."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20)
    reason = models.CharField(max_length=300)
    # Indexed only where a person acted (each subclass's Meta): the system's events, most
    # of them, are never looked up by actor and need not pay for the index.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    actor_label = models.CharField(max_length=150)

    class Meta:
        abstract = True
