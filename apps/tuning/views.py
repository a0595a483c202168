"""Pages: NCCL profiles (list, detail with lint results, edit for ops), the paste-and-lint
page and the catalogue of variables, open to every signed-in user."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from apps.accounts.selectors import roles_of
from apps.tuning import catalogue, linter, selectors, services
from apps.tuning.filtersets import NcclProfileFilterSet
from apps.tuning.forms import LintForm, ProfileForm, parse_env, parse_reasons
from apps.tuning.models import ANY_FABRIC, NcclProfile
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response

PROFILE_CSV_COLUMNS = [
    ("name", lambda p, v: p.name),
    ("title", lambda p, v: p.title),
    ("fabric", lambda p, v: p.fabric),
    ("single_node", lambda p, v: p.single_node),
    ("min_nccl_version", lambda p, v: p.min_nccl_version),
    ("max_nccl_version", lambda p, v: p.max_nccl_version),
    ("is_default", lambda p, v: p.is_default),
    ("built_in", lambda p, v: p.built_in),
    ("variables", lambda p, v: len(p.env or {})),
    ("errors", lambda p, v: v[linter.ERROR]),
    ("warnings", lambda p, v: v[linter.WARNING]),
    ("env", lambda p, v: " ".join(f"{k}={val}" for k, val in (p.env or {}).items())),
    ("updated_at", lambda p, v: p.updated_at.isoformat()),
]


def _can_edit(user) -> bool:
    return roles_of(user).manages_fleet


def _filtered(request):
    profiles = NcclProfileFilterSet(request.GET, queryset=selectors.profiles_visible())
    rows = []
    for profile in profiles.qs if profiles.is_valid() else []:
        rows.append((profile, linter.counts(profile.lint())))
    return profiles, rows


@login_required
def profiles(request):
    profile_filter, rows = _filtered(request)
    return render(
        request,
        "tuning/profiles.html",
        {"profile_filter": profile_filter, "rows": rows, "can_edit": _can_edit(request.user)},
    )


@login_required
def profiles_csv(request):
    _, rows = _filtered(request)
    return csv_response(
        "nccl-profiles.csv",
        [name for name, _ in PROFILE_CSV_COLUMNS],
        ([value(profile, found) for _, value in PROFILE_CSV_COLUMNS] for profile, found in rows),
    )


@login_required
def profile_detail(request, name: str):
    profile = get_object_or_404(selectors.profiles_visible(), name=name)
    verdicts = profile.lint()
    return render(
        request,
        "tuning/profile_detail.html",
        {
            "profile": profile,
            "verdicts": verdicts,
            "counts": linter.counts(verdicts),
            "file_text": linter.render_env_file(profile.env or {}),
            "can_edit": _can_edit(request.user),
            "versions": selectors.profile_versions(profile=profile),
        },
    )


@login_required
@require_POST
def profile_version_restore(request, name: str, number: int):
    """One action: an earlier version becomes the profile's environment again (as its next
    version), through the service, which lints it like any edit."""
    if not _can_edit(request.user):
        raise PermissionDenied("Only ops restore NCCL profile versions.")
    version = selectors.profile_version_get(profile_name=name, number=number)
    if version is None:
        raise Http404("No such version.")
    try:
        profile = services.nccl_profile_version_restore(version=version, by=request.user)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(
            request, f"Version {number} of {name} restored as version {profile.version}."
        )
    return redirect("tuning:profile", name=name)


def _show_problems(form: ProfileForm, exc: ApplicationError) -> None:
    for key, problems in (exc.details or {"__all__": [exc.message]}).items():
        field, _, variable = key.partition(".")
        target = field if field in form.fields and not form.fields[field].disabled else None
        for problem in problems if isinstance(problems, list) else [problems]:
            form.add_error(target, f"{variable}: {problem}" if variable else str(problem))


@login_required
def profile_edit(request, name: str | None = None):
    if not _can_edit(request.user):
        raise PermissionDenied("Only ops edit NCCL profiles.")
    profile = get_object_or_404(NcclProfile, name=name) if name else None
    form = ProfileForm(request.POST or None, profile=profile)
    if request.method == "POST" and form.is_valid():
        try:
            if profile is None:
                profile = services.nccl_profile_create(by=request.user, **form.to_fields())
                messages.success(request, f"Profile {profile.name} created.")
            else:
                services.nccl_profile_update(profile=profile, by=request.user, **form.to_fields())
                messages.success(request, f"Profile {profile.name} saved.")
        except ApplicationError as exc:
            _show_problems(form, exc)
        else:
            return redirect("tuning:profile", name=profile.name)
    draft_env, _ = parse_env(form["env"].value() or "")
    draft_reasons, _ = parse_reasons(form["reasons"].value() or "")
    return render(
        request,
        "tuning/profile_form.html",
        {
            "form": form,
            "profile": profile,
            "verdicts": linter.lint(
                draft_env,
                context=_context_from(request.POST or form.initial),
                reasons=draft_reasons,
            ),
        },
    )


@login_required
@require_POST
def profile_delete(request, name: str):
    profile = get_object_or_404(NcclProfile, name=name)
    try:
        services.nccl_profile_delete(profile=profile, by=request.user)
    except ApplicationError as exc:
        messages.error(request, exc.message)
        return redirect("tuning:profile", name=name)
    messages.success(request, f"Profile {name} deleted.")
    return redirect("tuning:profiles")


def _context_from(data) -> linter.Context:
    fabric = data.get("fabric") or ""
    version = data.get("nccl_version") or data.get("min_nccl_version") or ""
    single = data.get("single_node")
    return linter.Context(
        fabric="" if fabric == ANY_FABRIC or fabric not in catalogue.FABRICS else fabric,
        nccl_version=version if _is_version(version) else "",
        single_node=bool(single) and single not in ("false", "0"),
    )


def _is_version(text: str) -> bool:
    try:
        catalogue.version_tuple(text)
    except ValueError:
        return False
    return bool(text)


@login_required
def lint(request):
    """The paste-and-lint page; with htmx (the profile form, the Lint button) only the
    verdicts are answered. Everyone signed in may use it: it writes nothing."""
    form = LintForm(request.POST or None)
    verdicts, parsed = None, None
    if request.method == "POST":
        text = request.POST.get("text", request.POST.get("env", ""))
        verdicts, parsed = linter.lint_text(text[:200_000], context=_context_from(request.POST))
        reasons, _ = parse_reasons(request.POST.get("reasons", ""))
        if reasons:
            verdicts = linter.lint(
                parsed.environment(), context=_context_from(request.POST), reasons=reasons
            )
    context = {
        "form": form,
        "verdicts": verdicts,
        "counts": linter.counts(verdicts or []),
        "parsed": parsed,
    }
    if request.htmx:
        return render(request, "tuning/_verdicts.html", context)
    return render(request, "tuning/lint.html", context)


@login_required
def variables(request):
    family = request.GET.get("family", "")
    query = request.GET.get("q", "").strip().upper()
    rows = [
        var
        for var in sorted(catalogue.VARIABLES.values(), key=lambda v: v.name)
        if (not family or var.family == family) and (not query or query in var.name)
    ]
    return render(
        request,
        "tuning/variables.html",
        {
            "variables": rows,
            "sources": catalogue.SOURCES,
            "filters": {"family": family, "q": request.GET.get("q", "")},
            "invented": sorted(catalogue.INVENTED.items()),
        },
    )
