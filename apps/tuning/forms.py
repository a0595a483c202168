"""The pages' forms: a profile as ops edit it, and the paste-and-lint box."""

import re
import shlex

from django import forms

from apps.fleet.models import Fabric
from apps.tuning import linter
from apps.tuning.models import ANY_FABRIC, PROFILE_FABRICS, NcclProfile, version_validator

PLACEHOLDER = 'export NCCL_IB_HCA==mlx5_0,mlx5_1\nos.environ["NCCL_DEBUG"] = "WARN"'
_REASON_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(.+?)\s*$")


def env_as_text(env: dict) -> str:
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in env.items())


def reasons_as_text(reasons: dict) -> str:
    return "".join(f"{name}: {why}\n" for name, why in reasons.items())


def parse_env(text: str) -> tuple[dict[str, str], list[int]]:
    """The variables of a textarea, and the numbers of lines that set nothing."""
    parsed = linter.parse_text(text or "")
    return parsed.environment(), parsed.skipped


def parse_reasons(text: str) -> tuple[dict[str, str], list[int]]:
    reasons, bad = {}, []
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip():
            continue
        match = _REASON_LINE.match(line)
        if match:
            reasons[match.group(1)] = match.group(2)
        else:
            bad.append(number)
    return reasons, bad


def _lines(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers[:10])


class ProfileForm(forms.Form):
    name = forms.SlugField(
        max_length=50, help_text="Jobs name the profile by it; it never changes."
    )
    title = forms.CharField(max_length=200)
    description = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4}), required=False, max_length=4000
    )
    fabric = forms.ChoiceField(choices=PROFILE_FABRICS, initial=ANY_FABRIC)
    single_node = forms.BooleanField(required=False, label="For single-node jobs")
    min_nccl_version = forms.CharField(
        max_length=20, required=False, validators=[version_validator], label="Oldest NCCL"
    )
    max_nccl_version = forms.CharField(
        max_length=20, required=False, validators=[version_validator], label="Newest NCCL"
    )
    is_default = forms.BooleanField(
        required=False, label="Default for these nodes (jobs that name no profile get it)"
    )
    env = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 14, "spellcheck": "false"}),
        required=False,
        label="Variables",
        help_text="One NAME=value per line (export lines and os.environ lines work too).",
    )
    reasons = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}),
        required=False,
        help_text="NAME: why it is kept — needed for each variable the linter warns about.",
    )

    def __init__(self, data=None, *, profile: NcclProfile | None = None, **kwargs):
        self.profile = profile
        if profile is not None and "initial" not in kwargs:
            kwargs["initial"] = {
                "name": profile.name,
                "title": profile.title,
                "description": profile.description,
                "fabric": profile.fabric,
                "single_node": profile.single_node,
                "min_nccl_version": profile.min_nccl_version,
                "max_nccl_version": profile.max_nccl_version,
                "is_default": profile.is_default,
                "env": env_as_text(profile.env or {}),
                "reasons": reasons_as_text(profile.reasons or {}),
            }
        super().__init__(data, **kwargs)
        if profile is not None:
            self.fields["name"].disabled = True

    def clean_env(self) -> dict[str, str]:
        env, skipped = parse_env(self.cleaned_data.get("env", ""))
        if skipped:
            raise forms.ValidationError(f"Lines {_lines(skipped)} are not NAME=value.")
        return env

    def clean_reasons(self) -> dict[str, str]:
        reasons, bad = parse_reasons(self.cleaned_data.get("reasons", ""))
        if bad:
            raise forms.ValidationError(f"Lines {_lines(bad)} are not 'NAME: why'.")
        return reasons

    def to_fields(self) -> dict:
        data = dict(self.cleaned_data)
        if self.profile is not None:
            data.pop("name")
        return data


class LintForm(forms.Form):
    text = forms.CharField(
        widget=forms.Textarea(
            attrs={
                "rows": 16,
                "spellcheck": "false",
                "placeholder": PLACEHOLDER,
            }
        ),
        max_length=200_000,
        required=False,
        label="Environment block",
    )
    fabric = forms.ChoiceField(
        choices=[("", "Unknown"), *Fabric.choices], required=False, label="Nodes' fabric"
    )
    nccl_version = forms.CharField(
        max_length=20, required=False, validators=[version_validator], label="NCCL version"
    )
    single_node = forms.BooleanField(required=False, label="Single node")
