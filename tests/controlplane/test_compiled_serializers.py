"""The compiled check of a serializer gives DRF's validated data or steps aside: never a
different answer, and it does take the plain bodies it exists for."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rest_framework import serializers

from apps.jobs.api.serializers import JobSubmitSerializer, submit_body
from controlplane.api import SharedFieldsMixin, StrictSerializer, Text
from controlplane.compiled_serializers import NotPlain, compile_check, compile_representation

COMMAND_JOB = {
    "name": "ci-smoke",
    "team": 1,
    "time_limit_s": 3600,
    "command": {"argv": ["python", "eval.py"], "path": "/shared/eval"},
    "resources": {"gpu_type": "H100", "gpus": 8},
    "placement": {"where": "owned"},
}
TRAINER_JOB = {
    "name": " llama-7b ",
    "team": 3,
    "priority": "high",
    "time_limit_s": 7200,
    "max_cost_usd": "12.50",
    "restart_limit": 0,
    "trainer": {
        "preset": "1b",
        "dataset": "synthetic",
        "steps": 100,
        "global_batch": 32,
        "seq_len": 2048,
        "lr": 0.0003,
        "compile": True,
        "pipeline": {"schedule": "1f1b", "microbatches": 8},
    },
    "env": {"WANDB_MODE": "offline"},
    "secrets": ["HF_TOKEN"],
    "resources": {
        "gpu_type": "H200",
        "nodes": 2,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 2, "tp": 8},
    },
    "placement": {"where": "owned_then_cloud", "spot": True},
    "nccl": {"profile": "ib-default", "overrides": {"NCCL_DEBUG": "INFO"}},
}
GIT_JOB = {
    **COMMAND_JOB,
    "command": {"argv": ["torchrun", "train.py"], "git": {"repo": "https://git/x", "ref": "v1"}},
}


def drf_answer(data):
    """What the serializer says: (validated data as plain dicts) or None when it refuses."""
    body = JobSubmitSerializer(data=copy.deepcopy(data))
    return _plain(body.validated_data) if body.is_valid() else None


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


check = compile_check(JobSubmitSerializer)


@pytest.mark.parametrize(
    "body", [COMMAND_JOB, TRAINER_JOB, GIT_JOB], ids=["command", "trainer", "git"]
)
def test_plain_bodies_are_checked_without_the_serializer_and_alike(body):
    answer = check(copy.deepcopy(body))  # raises NotPlain if the check stepped aside
    assert answer == drf_answer(body)
    assert answer["name"] == body["name"].strip()
    assert answer["restart_limit"] == body.get("restart_limit", 3)  # a default filled in


# Values a field might be given: right ones, edges, and what DRF would coerce or refuse.
odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([59, 60, 61, 2592000, 2592001, 2**31, -(2**31), 10**20]),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from(
        [
            "",
            "   ",
            " padded ",
            "8",
            "3600",
            "1.0",
            "true",
            "x\x00y",
            "\ud800",
            "a" * 101,
            "H100",
            "any",
            "owned",
            "cloud",
            "urgent",
            "bogus",
            "https://git/x",
            "-rf",
        ]
    ),
    st.lists(st.sampled_from(["python", "", " x ", 3]), max_size=3),
    st.dictionaries(
        st.sampled_from(["A", "1B", "where", "gpus"]), st.sampled_from(["1", 2]), max_size=2
    ),
)


@st.composite
def bodies(draw):
    """A plain body with a few fields, at any depth, replaced, removed or added."""
    body = copy.deepcopy(draw(st.sampled_from([COMMAND_JOB, TRAINER_JOB, GIT_JOB])))
    for _ in range(draw(st.integers(0, 3))):
        parent = body
        while True:
            keys = sorted(parent)
            key = draw(st.sampled_from(keys)) if keys else None
            if key is not None and isinstance(parent[key], dict) and draw(st.booleans()):
                parent = parent[key]
                continue
            break
        change = draw(st.sampled_from(["replace", "remove", "add"]))
        if change == "add" or key is None:
            parent[draw(st.sampled_from(["spot", "gpus", "unknown", "priority", "tp"]))] = draw(
                odd_values
            )
        elif change == "remove":
            del parent[key]
        else:
            parent[key] = draw(odd_values)
    return body


@settings(max_examples=400, deadline=None)
@given(bodies())
def test_the_check_gives_what_drf_gives_or_steps_aside(body):
    expected = drf_answer(body)
    try:
        answer = check(copy.deepcopy(body))
    except NotPlain:
        return  # the serializer decides, as it always did
    assert expected is not None, "the check took a body the serializer refuses"
    assert answer == expected


def test_submit_body_gives_the_serializer_errors_for_a_body_it_refuses():
    body = {**COMMAND_JOB, "time_limit_s": 5, "resources": {"gpu_type": "H100", "gpus": "x"}}
    with pytest.raises(serializers.ValidationError) as refused:
        submit_body(body)
    assert "time_limit_s" in refused.value.detail
    assert "gpus" in refused.value.detail["resources"]


def test_submit_body_takes_a_valid_body_the_check_steps_aside_for():
    body = {**COMMAND_JOB, "time_limit_s": "3600"}  # DRF reads a numeric string as an int
    with pytest.raises(NotPlain):
        check(body)
    assert submit_body(body)["time_limit_s"] == 3600


class Named(StrictSerializer):
    name = Text(max_length=10)
    size = serializers.IntegerField(min_value=1, default=1)

    def validate_name(self, value):
        if value == "reserved":
            raise serializers.ValidationError("Taken.")
        return value.upper()


class Whole(StrictSerializer):
    low = serializers.IntegerField()
    high = serializers.IntegerField()

    def validate(self, attrs):
        if attrs["low"] > attrs["high"]:
            raise serializers.ValidationError("low above high")
        return {**attrs, "span": attrs["high"] - attrs["low"]}


class Renamed(StrictSerializer):
    label = Text(source="name")


def test_validate_methods_run_as_drf_runs_them():
    named = compile_check(Named)
    assert named({"name": " gpu "}) == {"name": "GPU", "size": 1}
    with pytest.raises(NotPlain):
        named({"name": "reserved"})
    with pytest.raises(NotPlain):
        named({"name": "gpu", "colour": "red"})  # unknown: the strict serializer refuses it


def test_serializers_it_does_not_walk_are_validated_by_drf():
    whole = compile_check(Whole)
    assert whole({"low": 1, "high": 4}) == {"low": 1, "high": 4, "span": 3}
    with pytest.raises(NotPlain):
        whole({"low": 5, "high": 4})
    assert compile_check(Renamed)({"label": "x"}) == {"name": "x"}


def _bounded_integers(serializer, path=()):
    """(path, low, high) of every bounded IntegerField in a serializer's tree."""
    for name, field in serializer.fields.items():
        if isinstance(field, serializers.Serializer):
            yield from _bounded_integers(field, (*path, name))
        elif type(field) is serializers.IntegerField:
            yield (*path, name), field.min_value, field.max_value


EDGES = [
    (path, value)
    for path, low, high in _bounded_integers(JobSubmitSerializer())
    for value in (low - 1, low, high, high + 1)
    if value is not None
]


@pytest.mark.parametrize(("path", "value"), EDGES, ids=[f"{'.'.join(p)}={v}" for p, v in EDGES])
def test_integer_bounds_edge_to_edge(path, value):
    body = copy.deepcopy(TRAINER_JOB)
    parent = body
    for name in path[:-1]:
        parent = parent.setdefault(name, {})
    parent[path[-1]] = value
    try:
        answer = check(copy.deepcopy(body))
    except NotPlain:
        answer = "stepped aside"
    expected = drf_answer(body)
    assert answer in (expected, "stepped aside")
    if expected is not None and answer == "stepped aside":
        # Only a body another rule refuses may be left to the serializer here.
        pytest.fail(f"the check stepped aside for a valid {'.'.join(path)}={value}")


class Owner:
    def __init__(self, name):
        self.name = name


class Thing:
    def __init__(self, **values):
        self.__dict__.update(values)

    def shout(self):
        return self.label.upper()


class ThingSerializer(SharedFieldsMixin, StrictSerializer):
    label = serializers.CharField()
    size = serializers.IntegerField()
    owner = serializers.CharField(source="owner.name", default=None)
    shout = serializers.CharField()  # a method: DRF calls it
    missing = serializers.CharField(required=False)  # no attribute, not required: left out
    made = serializers.DateTimeField()
    tags = serializers.ListField(child=serializers.CharField())
    upper = serializers.SerializerMethodField()

    def get_upper(self, thing):
        return thing.label.upper()


def test_a_compiled_representation_is_drfs():
    from datetime import UTC, datetime

    represent = compile_representation(ThingSerializer)
    things = [
        Thing(
            label="a", size=3, owner=Owner("ann"), made=datetime(2026, 1, 2, tzinfo=UTC), tags=["x"]
        ),
        Thing(label="b", size=4, made=None, tags=[]),  # no owner: its default
    ]
    for thing in things:
        assert represent(thing) == ThingSerializer(thing).data
    assert represent(things[0])["shout"] == "A" and "missing" not in represent(things[0])
    assert represent(things[1])["owner"] is None and represent(things[1])["made"] is None


def test_a_serializer_that_reads_its_context_is_represented_by_drf():
    class Contextual(StrictSerializer):
        label = serializers.CharField()

    represent = compile_representation(Contextual)
    assert represent(Thing(label="z")) == {"label": "z"}
