"""The Submit page's form: a person's view of the job spec, turned into the API's spec."""

from django import forms

from apps.accounts.models import GPU_TYPES, Team
from apps.accounts.selectors import roles_of
from apps.jobs.models import Placement, PriorityClass
from apps.jobs.specs import MAX_GPUS_PER_NODE
from workers.trainer.presets import PRESETS

GPU_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


class SubmitForm(forms.Form):
    name = forms.CharField(max_length=100)
    team = forms.ModelChoiceField(queryset=Team.objects.none())
    kind = forms.ChoiceField(
        choices=[("trainer", "Bundled trainer"), ("command", "Custom command")],
        initial="trainer",
    )
    preset = forms.ChoiceField(choices=[(p, p) for p in PRESETS], initial="tiny", required=False)
    gpu_type = forms.ChoiceField(choices=GPU_TYPES, initial="H100")
    gpus = forms.TypedChoiceField(choices=[(n, n) for n in GPU_COUNTS], coerce=int, initial=8)
    gpus_per_node = forms.IntegerField(min_value=1, max_value=MAX_GPUS_PER_NODE, initial=8)
    layout = forms.CharField(
        max_length=40, required=False, help_text="dp_replicate × dp_shard × tp × pp"
    )
    priority = forms.ChoiceField(choices=PriorityClass.choices, initial=PriorityClass.NORMAL)
    placement = forms.ChoiceField(choices=Placement.choices, initial=Placement.OWNED_THEN_CLOUD)
    spot = forms.BooleanField(required=False, label="Spot allowed")
    time_limit_hours = forms.DecimalField(min_value=0.1, max_value=720, initial=4)
    dataset = forms.CharField(max_length=1024, initial="synthetic", required=False)
    steps = forms.IntegerField(min_value=1, max_value=10_000_000, initial=1000, required=False)
    global_batch = forms.IntegerField(min_value=1, max_value=1_000_000, initial=64, required=False)
    seq_len = forms.IntegerField(min_value=1, max_value=1_048_576, initial=512, required=False)
    argv = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}),
        required=False,
        help_text="One argument per line (no shell).",
    )
    code_path = forms.CharField(max_length=1024, required=False, label="Code path")

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

    def nodes_and_per_node(self) -> tuple[int, int]:
        gpus = self.cleaned_data["gpus"]
        per_node = min(self.cleaned_data["gpus_per_node"], gpus)
        return max(gpus // per_node, 1), per_node

    def to_spec(self) -> dict:
        """The same spec the API takes, so both go through one set of rules."""
        data = self.cleaned_data
        nodes, per_node = self.nodes_and_per_node()
        resources = {
            "gpu_type": data["gpu_type"],
            "gpus": data["gpus"],
            "nodes": nodes,
            "gpus_per_node": per_node,
        }
        if data.get("layout"):
            replicate, shard, tp, pp = (int(x) for x in data["layout"].split("x"))
            resources["layout"] = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "pp": pp}
        spec = {
            "name": data["name"],
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
