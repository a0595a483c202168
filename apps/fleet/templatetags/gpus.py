"""Template filters for GPUs: `{{ node.gpus.all|gpu_marks }}` draws a node's GPUs as small
marks coloured by health (the Fleet page draws a hundred nodes' worth, so in Python rather
than in a template loop of a dozen lookups a GPU)."""

from html import escape

from django import template
from django.utils.safestring import SafeString, mark_safe

from apps.fleet.models import GpuHealth

register = template.Library()

HEALTH_LABELS = dict(GpuHealth.choices)


@register.filter
def gpu_marks(gpus) -> SafeString:
    """A mark per GPU, titled with its index, health and the reason for it."""
    marks = []
    for gpu in gpus:
        title = f"GPU {gpu.index} · {HEALTH_LABELS.get(gpu.health, gpu.health)}"
        if gpu.health_reason:
            title += f": {gpu.health_reason}"
        marks.append(
            f'<span class="gpu health-{escape(gpu.health)}" title="{escape(title)}"></span>'
        )
    return mark_safe("".join(marks))  # noqa: S308 (every text above is escaped)
