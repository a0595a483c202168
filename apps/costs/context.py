"""The budget banner: every page tells a team's members when its budget passed 50, 80 or 100%."""

from apps.costs.selectors import banners_for


def budget_banners(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"budget_banners": []}
    return {"budget_banners": banners_for(user=user)}
