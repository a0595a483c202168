"""The trainer's checkpoint lines as the agents relay them: one serializer per kind of line,
so the registry's services receive clean values. A bad value is a 400 naming the first bad
field of the line as `event.<name>`; values that only describe (loss, layout, time) are kept
where sound and dropped where not, since a line is still worth recording without them."""

from rest_framework import serializers

from apps.checkpoints.services.agent_input import (
    clean_text,
    finite_or_none,
    instant_or,
    invalid_input,
    layout_of,
    storable,
)
from apps.checkpoints.services.states import SHA256

LARGEST = 2**63 - 1
LARGEST_31 = 2**31 - 1


class Checked(serializers.Field):
    """A field whose own check answers for a missing or null value too (no DRF wording)."""

    def validate_empty_values(self, data):
        if data is serializers.empty and self.default is not serializers.empty:
            return True, self.get_default()
        return False, data


class WholeNumber(Checked):
    """A JSON integer from 0 to `maximum`: no strings, floats or booleans."""

    def __init__(self, *, maximum: int = LARGEST, **kwargs):
        self.maximum = maximum
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int) or not 0 <= data <= self.maximum:
            raise serializers.ValidationError(f"A whole number from 0 to {self.maximum}.")
        return data


def is_place(value, limit: int = 1024) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and storable(value)


class Place(Checked):
    """A path or URI the trainer named: storable text of at most 1,024 characters. Whether
    the job owns it is the service's question."""

    def __init__(self, *, optional: bool = False, s3: bool = False, **kwargs):
        self.optional, self.s3 = optional, s3
        super().__init__(**({"default": None} if optional else {}), **kwargs)

    def to_internal_value(self, data):
        if self.optional and data is None:
            return None
        if not is_place(data):
            raise serializers.ValidationError("Text of at most 1024 characters.")
        if self.s3 and not data.startswith("s3://"):
            raise serializers.ValidationError("An s3:// URI.")
        return data


class Digest(Checked):
    def to_internal_value(self, data):
        if not isinstance(data, str) or not SHA256.match(data):
            raise serializers.ValidationError("A SHA-256 in lowercase hex.")
        return data


class Kept(serializers.Field):
    """A describing value, normalised by `keep`; never an error."""

    def __init__(self, keep, **kwargs):
        self.keep = keep
        super().__init__(required=False, **kwargs)

    def validate_empty_values(self, data):
        return False, None if data is serializers.empty else data

    def to_internal_value(self, data):
        return self.keep(data)


def _text_or_none(value):
    return value if isinstance(value, str) else None


def _step_or_none(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def evaluation_of(value) -> dict | None:
    """The latest evaluation a checkpoint keeps (the trainer's "eval": step, loss, perplexity,
    ...), as {"step", "loss", "perplexity"}: a step that is a whole number and a finite loss
    from 0 up, or None; a perplexity that is not finite is left out (None)."""
    if not isinstance(value, dict):
        return None
    step, loss = _step_or_none(value.get("step")), finite_or_none(value.get("loss"))
    if step is None or not 0 <= step <= LARGEST_31 or loss is None or loss < 0:
        return None
    perplexity = finite_or_none(value.get("perplexity"))
    return {"step": step, "loss": loss, "perplexity": perplexity}


class CommittedReport(serializers.Serializer):
    step = WholeNumber(maximum=LARGEST_31)
    manifest_sha256 = Digest()
    path = Place()
    replaced = Kept(lambda value: value if is_place(value) else None)
    world_size = WholeNumber(maximum=LARGEST_31, default=1)
    layout = Kept(layout_of)
    size_bytes = WholeNumber(default=0)
    files = WholeNumber(maximum=LARGEST_31, default=0)
    loss = Kept(finite_or_none)
    time = Kept(lambda value: instant_or(value, None))
    eval = Kept(evaluation_of)

    def validate(self, attrs):
        # An evaluation after the step saved is not this checkpoint's: dropped, not refused.
        if attrs["eval"] and attrs["eval"]["step"] > attrs["step"]:
            attrs["eval"] = None
        return attrs


class CopiedReport(serializers.Serializer):
    step = WholeNumber(maximum=LARGEST_31)
    uri = Place(s3=True)


class CopyFailedReport(serializers.Serializer):
    step = WholeNumber(maximum=LARGEST_31)
    uri = Place()
    message = Kept(lambda value: clean_text(value or "the upload failed", 250))
    attempts = WholeNumber(maximum=1000, default=1)


class RejectedReport(serializers.Serializer):
    path = Place()
    reason = Kept(lambda value: clean_text(value or "it did not verify", 250))


class FetchedReport(serializers.Serializer):
    path = Place()
    uri = Place(optional=True)
    manifest_sha256 = Kept(_text_or_none)


class ResumedReport(serializers.Serializer):
    path = Place()
    step = Kept(_step_or_none)


REPORTS = {
    "checkpoint": CommittedReport,
    "checkpoint_copy": CopiedReport,
    "checkpoint_copy_failed": CopyFailedReport,
    "checkpoint_rejected": RejectedReport,
    "checkpoint_fetched": FetchedReport,
    "resume": ResumedReport,
}


def checkpoint_report_parse(event) -> dict | None:
    """The line's values, checked, with its kind as `event`; None for a kind of line the
    registry does not keep."""
    if not isinstance(event, dict):
        raise invalid_input("event", "A JSON object.")
    kind = event.get("event")
    report = REPORTS.get(kind)
    if report is None:
        return None
    checked = report(data=event)
    if not checked.is_valid():
        name = next(name for name in checked.fields if name in checked.errors)
        raise invalid_input(f"event.{name}", str(checked.errors[name][0]))
    return {"event": kind, **checked.validated_data}
