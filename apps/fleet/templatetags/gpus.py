"""Template filters of the Fleet page's pictures: `{{ gpus|gpu_marks }}` draws a node's GPUs
as small marks coloured by health, `{{ rack_view|rack_elevation }}` a rack's front with its
nodes (the page draws a hundred nodes' worth, so in Python rather than in template loops of
a dozen lookups a GPU or a rack unit)."""

from html import escape
from itertools import groupby
from operator import attrgetter

from django import template
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator

from apps.fleet.models import GpuHealth
from controlplane import charts

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


def _node_unit(node, unit: int, placed: bool) -> tuple[int, str, str, str, str]:
    title = f"{node.name} · {node.get_state_display()} · {node.gpu_count} GPU"
    title += "" if node.gpu_count == 1 else "s"
    if not placed:
        title += " · unit not recorded"
    classes = f"unit{'' if placed else ' unplaced'} state-{node.state}"
    href = reverse("fleet:node", args=[node.pk])
    return (unit, classes, title, href, Truncator(node.name).chars(24))


@register.filter
def rack_elevation(rack_view) -> SafeString:
    """The rack's elevation (selectors.RackView): each node in its unit; nodes with no
    recorded unit stacked from the bottom, dashed, and drawn first so that placed nodes stay
    on top."""
    # The nodes come by unit, then name: groups of one unit, as {% regroup %} makes them.
    slots = [
        (unit, list(nodes)) for unit, nodes in groupby(rack_view.nodes, attrgetter("rack_unit"))
    ]
    units = [
        _node_unit(node, stacked, placed=False)
        for unit, nodes in slots
        if not unit
        for stacked, node in enumerate(nodes, start=1)
    ]
    units += [
        _node_unit(node, unit, placed=True) for unit, nodes in slots if unit for node in nodes
    ]
    return charts.rack_elevation(
        label=rack_view.rack.name, height_units=rack_view.rack.height_units, units=units
    )
