"""A node's GPU telemetry through the API (`/api/v1/nodes/{id}/telemetry/`): each GPU's
series at the node page's resolution, as JSON or CSV, to whoever may see nodes, in a
bounded number of queries."""

import csv
import datetime as dt
import io

import pytest
from django.utils import timezone

from apps.fleet import telemetry
from apps.fleet.models import GpuMinute
from tests.apps.fleet.test_services import ready_node

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


def _at(seconds_ago: float) -> dt.datetime:
    return (timezone.now() - dt.timedelta(seconds=seconds_ago)).replace(microsecond=0)


@pytest.fixture
def node(db):
    """A node with raw samples every 10 s for the last 5 minutes (GPU i at 10·i + 5 %), and
    one-minute means each hour of the last two days (GPU i at 50 + i %)."""
    node = ready_node(name="tel-n1", gpu_count=4)
    rows = []
    for tick in range(30):
        at = _at(10 * tick + 5)
        rows += [(node.pk, at, i, 10 * i + 5, 1024 * i, 50 + i, 300 + i) for i in range(4)]
    telemetry.gpu_samples_record(rows=rows)
    GpuMinute.objects.bulk_create(
        GpuMinute(
            node=node,
            at=_at(3600 * hours + 1800).replace(second=0),
            gpu=i,
            utilization_pct=50 + i,
            memory_used_mib=2048,
            temperature_c=60,
            power_w=400,
        )
        for hours in range(48)
        for i in range(4)
    )
    return node


def _url(node, **query):
    from urllib.parse import urlencode

    return f"/api/v1/nodes/{node.pk}/telemetry/" + (f"?{urlencode(query)}" if query else "")


def test_the_last_hour_is_each_gpus_raw_readings(node, viewer, api_for):
    answer = api_for(viewer).get(_url(node))
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["resolution"] == "raw" and body["name"] == "tel-n1"
    assert [series["gpu"] for series in body["gpus"]] == [0, 1, 2, 3]
    gpu2 = body["gpus"][2]["points"]
    assert len(gpu2) == 30
    assert [p["at"] for p in gpu2] == sorted(p["at"] for p in gpu2)  # oldest first
    assert gpu2[0] == {
        "at": gpu2[0]["at"],
        "utilization_pct": 25.0,
        "memory_used_mib": 2048.0,
        "temperature_c": 52.0,
        "power_w": 302.0,
    }


def test_a_longer_span_is_minutes_then_hourly_means_and_gpu_narrows_it(node, viewer, api_for):
    client = api_for(viewer)
    day = client.get(_url(node, since=_at(6 * 3600).isoformat(), gpu=1)).json()
    assert day["resolution"] == "minute"
    assert [series["gpu"] for series in day["gpus"]] == [1]
    assert len(day["gpus"][0]["points"]) == 6  # one minute row an hour, 6 hours
    assert {p["utilization_pct"] for p in day["gpus"][0]["points"]} == {51.0}
    week = client.get(_url(node, since=_at(3 * 86400).isoformat(), gpu=3)).json()
    assert week["resolution"] == "hour"
    assert {p["utilization_pct"] for p in week["gpus"][0]["points"]} == {53.0}
    assert 47 <= len(week["gpus"][0]["points"]) <= 49
    # An hour of a day and a half ago: raw samples are no longer kept then, so minutes.
    past = client.get(
        _url(node, since=_at(36 * 3600 + 3600).isoformat(), until=_at(36 * 3600).isoformat())
    ).json()
    assert past["resolution"] == "minute" and len(past["gpus"]) == 4


def test_csv_is_one_row_per_gpu_and_point(node, viewer, api_for):
    answer = api_for(viewer).get(_url(node, format="csv", gpu=0))
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/csv")
    assert 'filename="tel-n1-telemetry.csv"' in answer["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(answer.content.decode())))
    assert rows[0] == [
        "node",
        "gpu",
        "at",
        "utilization_pct",
        "memory_used_mib",
        "temperature_c",
        "power_w",
    ]
    assert len(rows) == 31 and {row[1] for row in rows[1:]} == {"0"}
    assert rows[1][0] == "tel-n1" and rows[1][3:] == ["5.0", "0.0", "50.0", "300.0"]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-13-01T00:00:00Z"}, "until"),
        ({"since": "2026-12-02T00:00:00Z", "until": "2026-12-01T00:00:00Z"}, "since"),
        ({"since": "2026-10-01T00:00:00Z", "until": "2026-12-01T00:00:00Z"}, "since"),
        ({"gpu": "first"}, "gpu"),
        ({"gpu": -1}, "gpu"),
        ({"gpu": 64}, "gpu"),
        ({"window": "1h"}, "window"),  # the page's parameter, not the API's
    ],
)
@pytest.mark.parametrize("form", ["json", "csv"])
def test_a_bad_value_is_a_json_400_naming_it(node, viewer, api_for, query, field, form):
    answer = api_for(viewer).get(_url(node, **query, format=form))
    assert answer.status_code == 400, answer.content
    assert answer["Content-Type"] == "application/json"
    assert list(answer.json()["error"]["details"]) == [field]


def test_whoever_may_see_nodes_may_read_it_and_no_one_else(node, viewer, api_for, anon_api):
    assert api_for(viewer, scopes=("read",)).get(_url(node)).status_code == 200
    assert anon_api.get(_url(node)).status_code == 401
    assert anon_api.get(_url(node, format="csv"))["Content-Type"] == "application/json"
    missing = api_for(viewer).get(f"/api/v1/nodes/{node.pk + 1000}/telemetry/")
    assert missing.status_code == 404


def test_the_queries_are_as_many_for_one_gpu_or_eight_over_an_hour_or_a_month(
    viewer, api_for, django_assert_max_num_queries
):
    client = api_for(viewer)
    small = ready_node(name="tel-small", gpu_count=1)
    big = ready_node(name="tel-big", gpu_count=8)
    for node, gpus in ((small, 1), (big, 8)):
        telemetry.gpu_samples_record(
            rows=[
                (node.pk, _at(10 * t), i, 50, 1024, 60, 400) for t in range(60) for i in range(gpus)
            ]
        )
        GpuMinute.objects.bulk_create(
            GpuMinute(node=node, at=_at(60 * m).replace(second=0), gpu=i, utilization_pct=50)
            for m in range(0, 30 * 1440, 97)
            for i in range(gpus)
        )
    client.get(_url(small))  # warm: the token's last-used write happens once
    # The node and its readings (the token's lookup is cached), however many GPUs and points.
    with django_assert_max_num_queries(2) as one:
        client.get(_url(small))
    for node in (small, big):
        for query in ({}, {"since": _at(29 * 86400).isoformat()}, {"format": "csv"}):
            with django_assert_max_num_queries(len(one.captured_queries)):
                assert client.get(_url(node, **query)).status_code == 200


def test_the_schema_documents_it(client):
    import yaml

    schema = yaml.safe_load(client.get("/api/schema/").content)
    operation = schema["paths"]["/api/v1/nodes/{id}/telemetry/"]["get"]
    described = {p["name"]: p.get("description", "") for p in operation["parameters"]}
    assert {"since", "until", "gpu", "format"} <= described.keys()
    assert all(described[name] for name in ("since", "until", "gpu", "format"))
    assert {"application/json", "text/csv"} <= operation["responses"]["200"]["content"].keys()
