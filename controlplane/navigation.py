"""The main navigation; a section whose page does not resolve (its app not installed) is
shown as not available, and one the user may not enter (Django's admin, for users who are
not staff) is not shown."""

from django.urls import NoReverseMatch, reverse

SECTIONS = [
    ("Queue", "jobs:queue"),
    ("Datasets", "jobs:datasets"),
    ("Fleet", "fleet:overview"),
    ("NCCL profiles", "tuning:profiles"),
    ("NCCL lint", "tuning:lint"),
    ("NCCL tuning", "tuning-runs:list"),
    ("Costs", "costs:overview"),
    ("Checkpoints", "checkpoints:overview"),
    ("Admin", "admin:index"),  # staff only (STAFF_ONLY)
    ("API docs", "api-docs"),
]


STAFF_ONLY = {"admin:index"}


def navigation(request):
    user = getattr(request, "user", None)
    staff = bool(user is not None and user.is_active and user.is_staff)
    items = []
    for label, name in SECTIONS:
        if name in STAFF_ONLY and not staff:
            continue
        try:
            url = reverse(name)
        except NoReverseMatch:
            url = None
        items.append({"label": label, "url": url, "active": False})
    # One section is current: the one whose address is the longest prefix of the path
    # (Datasets at /jobs/datasets/, not Queue at /jobs/ as well).
    path = getattr(request, "path", "")
    matching = [i for i in items if i["url"] and i["url"] != "/" and path.startswith(i["url"])]
    if matching:
        max(matching, key=lambda item: len(item["url"]))["active"] = True
    return {"nav_items": items}
