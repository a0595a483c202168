"""The logs API's filters (rank, attempt, q), the Job page's log viewer's, through the
same selector: each one narrows the lines, follows with `after`, and a bad value is a 400
naming its parameter."""

import pytest

from apps.jobs.models import Run
from tests.apps.jobs.test_live_pages import _lines, two_attempts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db


def _texts(answer) -> list[str]:
    assert answer.status_code == 200, answer.content
    return [line["text"] for line in answer.json()["lines"]]


@pytest.fixture
def logs(two_attempts, researcher, api_for):  # noqa: F811
    client = api_for(researcher)
    return lambda **query: client.get(f"/api/v1/jobs/{two_attempts.pk}/logs/", query)


def test_no_filter_is_every_line_in_arrival_order(logs):
    assert _texts(logs()) == [
        "a1 r0 hello",
        "a1 r0 Loss 3.0",
        "a1 r1 hello",
        "a1 r1 loss 3.1",
        "a2 r0 hello",
        "a2 r0 LOSS 2.0",
    ]


def test_rank_keeps_one_node_ranks_lines(logs):
    answer = logs(rank=1)
    assert _texts(answer) == ["a1 r1 hello", "a1 r1 loss 3.1"]
    assert {line["rank"] for line in answer.json()["lines"]} == {1}


def test_attempt_keeps_one_attempts_lines(logs):
    answer = logs(attempt=2)
    assert _texts(answer) == ["a2 r0 hello", "a2 r0 LOSS 2.0"]
    assert {line["attempt"] for line in answer.json()["lines"]} == {2}


def test_q_keeps_the_lines_holding_the_text_in_any_case(logs):
    assert _texts(logs(q="loss")) == ["a1 r0 Loss 3.0", "a1 r1 loss 3.1", "a2 r0 LOSS 2.0"]
    assert _texts(logs(q="  loss  ", rank=0)) == ["a1 r0 Loss 3.0", "a2 r0 LOSS 2.0"]
    assert _texts(logs(q="")) == _texts(logs())  # an empty search is no filter
    assert _texts(logs(q="no such text")) == []


def test_the_filters_combine_and_follow_with_after(logs, two_attempts):  # noqa: F811
    first = logs(q="loss", attempt=1, limit=1)
    assert _texts(first) == ["a1 r0 Loss 3.0"]
    after = first.json()["next_after"]
    assert _texts(logs(q="loss", attempt=1, after=after)) == ["a1 r1 loss 3.1"]
    # A new line the filters keep is the next one asked for; one they drop is not.
    run = Run.objects.get(job=two_attempts, attempt=2)
    _lines(run, ["a2 r0 loss 1.9", "a2 r0 saved"], first_seq=9)
    followed = logs(
        rank=0, attempt=2, q="loss", after=logs(rank=0, attempt=2).json()["lines"][1]["id"]
    )
    assert _texts(followed) == ["a2 r0 loss 1.9"]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"rank": "first"}, "rank"),
        ({"rank": -1}, "rank"),
        ({"rank": 2**31}, "rank"),
        ({"attempt": "latest"}, "attempt"),
        ({"attempt": -2}, "attempt"),
        ({"attempt": "1.5"}, "attempt"),
        ({"q": "x" * 201}, "q"),
        ({"q": "lo\x00ss"}, "q"),
        ({"after": -1}, "after"),
        ({"limit": 0}, "limit"),
        ({"grep": "loss"}, "grep"),  # the CLI's name, not the API's: unknown
    ],
)
def test_a_bad_value_is_a_400_naming_its_parameter(logs, query, field):
    answer = logs(**query)
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid" and list(error["details"]) == [field]


def test_the_schema_documents_the_filters(client):
    import yaml

    schema = yaml.safe_load(client.get("/api/schema/").content)
    operation = schema["paths"]["/api/v1/jobs/{id}/logs/"]["get"]
    described = {p["name"]: p.get("description", "") for p in operation["parameters"]}
    assert {"rank", "attempt", "q", "after", "limit"} <= described.keys()
    assert "node rank" in described["rank"] and "attempt" in described["attempt"]
    assert "any case" in described["q"]
