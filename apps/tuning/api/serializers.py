"""JSON shapes of NCCL profiles and their versions, the catalogue and lint verdicts."""

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from apps.fleet.models import Fabric
from apps.fleet.models.pools import NCCL_VERSION_PATTERN
from apps.tuning import linter
from apps.tuning.models import NcclProfile, NcclProfileVersion, VersionSource
from controlplane.api import StrictModelSerializer, StrictSerializer, Text

MAX_VARIABLES = 256


class EnvironmentField(serializers.DictField):
    """Variable name → value; names as a shell takes them."""

    child = Text(max_length=4096, allow_blank=True)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        bad = sorted(name for name in value if not linter.NAME_RE.match(name))
        if bad:
            raise serializers.ValidationError(f"Not environment variable names: {', '.join(bad)}.")
        if len(value) > MAX_VARIABLES:
            raise serializers.ValidationError(f"At most {MAX_VARIABLES} variables.")
        return value


class ReasonsField(EnvironmentField):
    child = Text(max_length=500)


class VerdictSerializer(StrictSerializer):
    level = serializers.ChoiceField(choices=[linter.ERROR, linter.WARNING, linter.OK])
    name = serializers.CharField()
    value = serializers.CharField()
    reason = serializers.CharField()
    suggestions = serializers.ListField(child=serializers.CharField())
    kept_because = serializers.CharField(help_text="The reason given for keeping a warning.")


class NcclProfileSerializer(StrictModelSerializer):
    env = EnvironmentField(required=False)
    reasons = ReasonsField(
        required=False, help_text="Why a variable the linter warns about is kept, by name."
    )
    lint = serializers.SerializerMethodField(help_text="The linter's verdict on each variable.")
    updated_by = serializers.CharField(
        source="updated_by.username", read_only=True, default=None, allow_null=True
    )

    class Meta:
        model = NcclProfile
        fields = [
            "id",
            "name",
            "title",
            "description",
            "fabric",
            "single_node",
            "min_nccl_version",
            "max_nccl_version",
            "is_default",
            "env",
            "reasons",
            "built_in",
            "version",
            "lint",
            "created_at",
            "updated_at",
            "updated_by",
        ]
        read_only_fields = ["built_in", "version", "created_at", "updated_at"]

    @extend_schema_field(VerdictSerializer(many=True))
    def get_lint(self, profile) -> list[dict]:
        return [verdict.as_dict() for verdict in profile.lint()]


@extend_schema_serializer(component_name="Lint")
class LintRequestSerializer(StrictSerializer):
    """NCCL variables to check: as text or as a mapping, for a fabric and NCCL version."""

    text = Text(
        max_length=200_000,
        required=False,
        allow_blank=True,
        help_text='`export NAME=value`, `NAME=value` or `os.environ["NAME"] = "value"` lines; '
        "other lines are skipped.",
    )
    env = EnvironmentField(required=False, help_text="Or the variables as a mapping.")
    fabric = serializers.ChoiceField(
        choices=Fabric.choices, required=False, allow_blank=True, default=""
    )
    nccl_version = serializers.RegexField(
        NCCL_VERSION_PATTERN, max_length=20, required=False, allow_blank=True, default=""
    )
    single_node = serializers.BooleanField(default=False)

    def validate(self, attrs):
        if ("text" in attrs) == ("env" in attrs):
            raise serializers.ValidationError({"text": ["Give text or env, one of them."]})
        return attrs


class LintCountsSerializer(StrictSerializer):
    error = serializers.IntegerField()
    warning = serializers.IntegerField()
    ok = serializers.IntegerField()


class LintResultSerializer(StrictSerializer):
    verdicts = VerdictSerializer(many=True)
    counts = LintCountsSerializer()
    ignored_lines = serializers.IntegerField(help_text="Lines of text that set nothing.")


class VariableSerializer(StrictSerializer):
    name = serializers.CharField()
    family = serializers.CharField(help_text="nccl, torch or efa.")
    kind = serializers.CharField()
    summary = serializers.CharField()
    source = serializers.CharField()
    default = serializers.CharField(allow_null=True)
    choices = serializers.ListField(child=serializers.CharField())
    minimum = serializers.IntegerField(allow_null=True)
    maximum = serializers.IntegerField(allow_null=True)
    since = serializers.CharField()
    removed_in = serializers.CharField()
    renamed_to = serializers.CharField()
    superseded_by = serializers.CharField()
    debugging = serializers.BooleanField()
    documented = serializers.BooleanField()
    discouraged = serializers.CharField()
    fabrics = serializers.ListField(child=serializers.CharField())
    note = serializers.CharField()


class NcclProfileVersionSerializer(StrictModelSerializer):
    """A profile's environment as it stood from `made_at`, and where it came from: an edit,
    a tuning run's adoption (`tuning_run`), or a restore."""

    source = serializers.ChoiceField(choices=VersionSource.choices)
    made_by = serializers.CharField(
        source="made_by.username", read_only=True, default=None, allow_null=True
    )
    tuning_run = serializers.IntegerField(source="tuning_run_id", allow_null=True)
    current = serializers.SerializerMethodField(help_text="Whether jobs get this version now.")

    class Meta:
        model = NcclProfileVersion
        fields = [
            "number",
            "source",
            "note",
            "made_at",
            "made_by",
            "tuning_run",
            "current",
            "env",
            "reasons",
        ]
        read_only_fields = fields

    def get_current(self, version) -> bool:
        return version.number == version.profile.version
