"""The main navigation; a section whose app has not landed yet is shown as not available."""

from django.urls import NoReverseMatch, reverse

SECTIONS = [
    ("Queue", "jobs:queue"),
    ("Fleet", "fleet:overview"),
    ("NCCL profiles", "tuning:profiles"),
    ("NCCL lint", "tuning:lint"),
    ("Costs", "costs:overview"),
    ("Checkpoints", "checkpoints:overview"),
    ("Admin", "admin:index"),
    ("API docs", "api-docs"),
]


def navigation(request):
    items = []
    for label, name in SECTIONS:
        try:
            url = reverse(name)
        except NoReverseMatch:
            url = None
        active = bool(url) and request.path.startswith(url) and url != "/"
        items.append({"label": label, "url": url, "active": active})
    return {"nav_items": items}
