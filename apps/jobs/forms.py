"""The Submit page's form: a person's view of the job spec, turned into the API's spec.

The form reads types only; the spec it makes goes through the API's submit serializer
and service, whose errors land back on the form's fields (errors_from_spec)."""

from django import forms

from apps.accounts.models import GPU_TYPES, Team
from apps.accounts.selectors import roles_of
from apps.jobs.models import Placement, PriorityClass
from workers.trainer.presets import PRESETS

GPU_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

# Spec fields the form asks for in another unit: their errors say which unit they count in.
SPEC_UNITS = {"time_limit_s": "seconds (this field is in hours; 1 h = 3,600 s)"}

# Where an error on a spec field (its path in the API's spec) is shown on the form.
SPEC_FIELDS = {
    "name": "name",
    "team": "team",
    "priority": "priority",
    "time_limit_s": "time_limit_hours",
    "resources.gpu_type": "gpu_type",
    "resources.gpus": "gpus",
    "resources.nodes": "gpus",
    "resources.gpus_per_node": "gpus_per_node",
    "resources.layout": "layout",
    "placement.where": "placement",
    "placement.spot": "spot",
    "trainer.preset": "preset",
    "trainer.dataset": "dataset",
    "trainer.steps": "steps",
    "trainer.global_batch": "global_batch",
    "trainer.seq_len": "seq_len",
    "command.argv": "argv",
    "command.path": "code_path",
}


class SubmitForm(forms.Form):
    name = forms.CharField()
    team = forms.ModelChoiceField(queryset=Team.objects.none())
    kind = forms.ChoiceField(
        choices=[("trainer", "Bundled trainer"), ("command", "Custom command")],
        initial="trainer",
    )
    preset = forms.CharField(
        widget=forms.Select(choices=[(p, p) for p in PRESETS]), initial="tiny", required=False
    )
    gpu_type = forms.CharField(widget=forms.Select(choices=GPU_TYPES), initial="H100")
    gpus = forms.IntegerField(widget=forms.Select(choices=[(n, n) for n in GPU_COUNTS]), initial=8)
    gpus_per_node = forms.IntegerField(initial=8)
    layout = forms.CharField(required=False, help_text="dp_replicate × dp_shard × tp × pp")
    priority = forms.CharField(
        widget=forms.Select(choices=PriorityClass.choices), initial=PriorityClass.NORMAL
    )
    placement = forms.CharField(
        widget=forms.Select(choices=Placement.choices), initial=Placement.OWNED_THEN_CLOUD
    )
    spot = forms.BooleanField(required=False, label="Spot allowed")
    time_limit_hours = forms.DecimalField(max_digits=12, initial=4)
    dataset = forms.CharField(initial="synthetic", required=False)
    steps = forms.IntegerField(initial=1000, required=False)
    global_batch = forms.IntegerField(initial=64, required=False)
    seq_len = forms.IntegerField(initial=512, required=False)
    argv = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}),
        required=False,
        help_text="One argument per line (no shell).",
    )
    code_path = forms.CharField(required=False, label="Code path")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        roles = roles_of(user)
        teams = Team.objects.order_by("name")
        if not roles.superuser:
            teams = teams.filter(id__in=[t for t in roles.team_ids if roles.can_submit_for(t)])
        self.fields["team"].queryset = teams

    def clean_layout(self):
        value = self.cleaned_data.get("layout", "").strip()
        if not value:
            return ""
        parts = value.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise forms.ValidationError(
                "Choose a layout: dp_replicate x dp_shard x tp x pp, each at least 1."
            )
        return value

    def to_spec(self) -> dict:
        """The body the API takes, so both go through one set of rules."""
        data = self.cleaned_data
        gpus = data["gpus"]
        per_node = min(data["gpus_per_node"], gpus)
        resources = {
            "gpu_type": data["gpu_type"],
            "gpus": gpus,
            "nodes": max(gpus // per_node, 1) if per_node > 0 else 1,
            "gpus_per_node": per_node,
        }
        if data.get("layout"):
            replicate, shard, tp, pp = (int(x) for x in data["layout"].split("x"))
            resources["layout"] = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "pp": pp}
        spec = {
            "name": data["name"],
            "team": data["team"].pk,
            "priority": data["priority"],
            "time_limit_s": int(data["time_limit_hours"] * 3600),
            "resources": resources,
            "placement": {"where": data["placement"], "spot": data["spot"]},
        }
        if data["kind"] == "trainer":
            spec["trainer"] = {
                "preset": data.get("preset") or "tiny",
                "dataset": data.get("dataset") or "synthetic",
                "steps": data.get("steps") or 1000,
                "global_batch": data.get("global_batch") or 64,
                "seq_len": data.get("seq_len") or 512,
            }
        else:
            argv = [line.strip() for line in (data.get("argv") or "").splitlines() if line.strip()]
            spec["command"] = {"argv": argv, "path": data.get("code_path") or ""}
        return spec

    def add_spec_errors(self, errors: dict, path: str = "") -> None:
        """The submit serializer's errors (nested by the spec's shape) on the fields that
        made them; one with no such field at the top, named by its path."""
        for key, problems in errors.items():
            # DRF files an error on a whole part under "non_field_errors": the part's own.
            where = path if key == "non_field_errors" else ".".join(filter(None, [path, key]))
            if isinstance(problems, dict):
                self.add_spec_errors(problems, where)
                continue
            if isinstance(problems, list) and problems and isinstance(problems[0], dict):
                for index, item in enumerate(problems):
                    self.add_spec_errors(item, f"{where}.{index}")
                continue
            field = _form_field(where)
            for problem in problems if isinstance(problems, list) else [problems]:
                if where in SPEC_UNITS:
                    problem = f"{problem} In {SPEC_UNITS[where]}."
                self.add_error(field, problem if field or not where else f"{where}: {problem}")


def _form_field(path: str) -> str | None:
    """The form field an error at this spec path belongs on: the path's, or its parent's."""
    while path:
        if path in SPEC_FIELDS:
            return SPEC_FIELDS[path]
        path = path.rpartition(".")[0]
    return None
