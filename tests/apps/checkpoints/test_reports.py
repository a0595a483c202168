"""The trainer's checkpoint lines are checked by one serializer per kind before the registry
sees them: a bad value is a 400 naming the first bad field, a describing value is dropped."""

import pytest

from apps.checkpoints.api.reports import checkpoint_report_parse
from controlplane.errors import ApplicationError

DIGEST = "a" * 64


def line(**values):
    return {"event": "checkpoint", "step": 5, "manifest_sha256": DIGEST, "path": "/c/5", **values}


def refusal(event) -> tuple[str, list]:
    with pytest.raises(ApplicationError) as refused:
        checkpoint_report_parse(event)
    assert refused.value.status == 400
    return refused.value.message, refused.value.details


def test_a_sound_line_gets_its_defaults_and_keeps_only_sound_descriptions():
    report = checkpoint_report_parse(line(loss=float("nan"), layout={"dp": 2, "tp": 0}, time=-1))
    assert report == {
        "event": "checkpoint",
        "step": 5,
        "manifest_sha256": DIGEST,
        "path": "/c/5",
        "replaced": None,
        "world_size": 1,
        "layout": {"dp": 2},
        "size_bytes": 0,
        "files": 0,
        "loss": None,
        "time": None,
        "eval": None,
    }


@pytest.mark.parametrize("step", ["5", 5.0, True, -1, 2**31, None])
def test_a_step_that_is_not_a_whole_number_in_range_is_refused_by_name(step):
    message, details = refusal(line(step=step))
    assert message == "Invalid input: event.step."
    assert details == {"event.step": [f"A whole number from 0 to {2**31 - 1}."]}


def test_the_first_bad_field_of_the_line_is_the_one_named():
    message, _ = refusal(line(manifest_sha256="A" * 64, path="", world_size=-1))
    assert message == "Invalid input: event.manifest_sha256."
    message, details = refusal(line(world_size=None))
    assert details == {"event.world_size": [f"A whole number from 0 to {2**31 - 1}."]}


def test_a_copy_names_an_s3_uri_and_other_kinds_are_not_kept():
    _, details = refusal({"event": "checkpoint_copy", "step": 1, "uri": "/tmp/x"})
    assert details == {"event.uri": ["An s3:// URI."]}
    _, details = refusal({"event": "checkpoint_fetched", "path": "/c/1", "uri": "bad\x00"})
    assert details == {"event.uri": ["Text of at most 1024 characters."]}
    assert checkpoint_report_parse({"event": "step", "loss": 1.0}) is None
    _, details = refusal(["not", "an", "object"])
    assert details == {"event": ["A JSON object."]}
