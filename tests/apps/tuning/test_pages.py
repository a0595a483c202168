"""The NCCL pages through the Django test client: profiles (list, CSV, detail, edit for ops),
the paste-and-lint page (full page and htmx partial) and the catalogue."""

import csv
import io
import re

import pytest

from apps.accounts.models import AuditEvent
from apps.tuning.models import NcclProfile

pytestmark = pytest.mark.django_db


def logged_in(client, user):
    client.force_login(user)
    return client


def rows_of(html: str, attribute: str) -> list[str]:
    return re.findall(rf'<tr {attribute}="([^"]+)"', html)


def test_the_navigation_has_the_nccl_pages(client, viewer):
    html = logged_in(client, viewer).get("/nccl/profiles/").content.decode()
    assert '<a href="/nccl/profiles/" class="active" aria-current="page">NCCL profiles</a>' in html
    assert '<a href="/nccl/lint/">NCCL lint</a>' in html


@pytest.mark.parametrize(
    "path, current",
    [("/jobs/datasets/", "Datasets"), ("/jobs/", "Queue"), ("/jobs/history/", "Queue")],
)
def test_only_the_section_with_the_longest_matching_address_is_current(
    client, viewer, path, current
):
    html = logged_in(client, viewer).get(path).content.decode()
    assert re.findall(r'class="active" aria-current="page">([^<]+)</a>', html) == [current]


def test_the_admin_link_is_shown_only_to_staff(client, viewer, ops_user, superuser):
    for user in (viewer, ops_user):
        html = logged_in(client, user).get("/nccl/profiles/").content.decode()
        assert ">Admin</a>" not in html
        assert '<a href="/nccl/lint/">NCCL lint</a>' in html
    html = logged_in(client, superuser).get("/nccl/profiles/").content.decode()
    assert '<a href="/admin/">Admin</a>' in html


def test_pages_name_their_icon_so_browsers_do_not_ask_for_a_missing_one(client, viewer):
    html = logged_in(client, viewer).get("/nccl/profiles/").content.decode()
    assert re.search(r'<link rel="icon" href="[^"]*favicon\.svg"', html)


def test_the_profiles_page_lists_profiles_with_their_lint(client, viewer, ops_user):
    html = logged_in(client, viewer).get("/nccl/profiles/").content.decode()
    assert "<h1>NCCL profiles</h1>" in html
    assert rows_of(html, "data-profile") == ["efa-p5", "ib-nvswitch-8gpu", "single-node"]
    assert html.count('class="badge level-ok">clean</span>') == 3
    assert "New profile" not in html
    assert "New profile" in logged_in(client, ops_user).get("/nccl/profiles/").content.decode()


def test_the_profiles_csv_uses_the_same_filters(client, viewer):
    response = logged_in(client, viewer).get("/nccl/profiles.csv", {"fabric": "efa"})
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0][:3] == ["name", "title", "fabric"]
    assert [row[0] for row in rows[1:]] == ["efa-p5"]
    assert "NCCL_NET=AWS Libfabric" in rows[1][-2]


def test_a_profile_page_shows_each_variable_s_verdict(client, viewer):
    html = logged_in(client, viewer).get("/nccl/profiles/ib-nvswitch-8gpu/").content.decode()
    assert "<h1>Owned 8-GPU NVSwitch nodes on InfiniBand</h1>" in html
    assert 'data-variable="NCCL_IB_TIMEOUT" data-level="ok"' in html
    assert "export NCCL_IB_HCA==mlx5_0,mlx5_1" in html
    assert "/edit/" not in html


def test_only_ops_open_the_edit_form(client, viewer, researcher):
    for user in (viewer, researcher):
        assert logged_in(client, user).get("/nccl/profiles/efa-p5/edit/").status_code == 403
        assert logged_in(client, user).get("/nccl/profiles/new/").status_code == 403


def form(profile=None, **changes):
    data = {
        "name": "rack-a3",
        "title": "Rack A3 workaround",
        "description": "",
        "fabric": "infiniband",
        "min_nccl_version": "2.21",
        "max_nccl_version": "",
        "env": "export NCCL_IB_TIMEOUT=23\nNCCL_ALGO=Ring\n",
        "reasons": "NCCL_ALGO: Tree hangs on rack A3 (ticket 812)\n",
    }
    data.update(changes)
    return data


def test_ops_create_a_profile_from_the_form(client, ops_user):
    response = logged_in(client, ops_user).post("/nccl/profiles/new/", form())
    assert response.status_code == 302 and response["Location"] == "/nccl/profiles/rack-a3/"
    profile = NcclProfile.objects.get(name="rack-a3")
    assert profile.env == {"NCCL_IB_TIMEOUT": "23", "NCCL_ALGO": "Ring"}
    assert profile.reasons == {"NCCL_ALGO": "Tree hangs on rack A3 (ticket 812)"}
    assert AuditEvent.objects.filter(action="nccl_profile.create", actor=ops_user).exists()
    html = client.get("/nccl/profiles/rack-a3/").content.decode()
    assert 'data-variable="NCCL_ALGO" data-level="warning"' in html
    assert "Kept: Tree hangs on rack A3 (ticket 812)" in html


def test_the_form_shows_the_linter_s_refusal_inline(client, ops_user):
    response = logged_in(client, ops_user).post(
        "/nccl/profiles/new/", form(env="NCCL_ORDER_VIA_NVLINK=1\nNCCL_PROTO=Simple\n", reasons="")
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "The profile was not saved" in html
    assert "NCCL_ORDER_VIA_NVLINK: Not an NCCL variable" in html
    assert "Give reasons.NCCL_PROTO to keep it." in html
    assert 'data-variable="NCCL_ORDER_VIA_NVLINK" data-level="error"' in html
    assert not NcclProfile.objects.filter(name="rack-a3").exists()


def test_editing_keeps_the_name_and_lines_that_set_nothing_are_refused(client, ops_user):
    client = logged_in(client, ops_user)
    page = client.get("/nccl/profiles/single-node/edit/").content.decode()
    assert "NCCL_DEBUG=WARN" in page and "disabled" in page
    bad = client.post(
        "/nccl/profiles/single-node/edit/", form(fabric="any", env="just words\n", reasons="")
    )
    assert "Lines 1 are not NAME=value." in bad.content.decode()
    good = client.post(
        "/nccl/profiles/single-node/edit/",
        form(
            name="ignored", title="One node", fabric="any", env="NCCL_DEBUG=VERSION\n", reasons=""
        ),
    )
    assert good.status_code == 302
    profile = NcclProfile.objects.get(name="single-node")
    assert (profile.title, profile.env) == ("One node", {"NCCL_DEBUG": "VERSION"})


def test_ops_delete_their_profiles_but_not_the_built_in_ones(client, ops_user):
    client = logged_in(client, ops_user)
    client.post("/nccl/profiles/new/", form())
    assert client.post("/nccl/profiles/rack-a3/delete/").status_code == 302
    assert not NcclProfile.objects.filter(name="rack-a3").exists()
    refused = client.post("/nccl/profiles/efa-p5/delete/", follow=True)
    assert "is built in: edit it instead" in refused.content.decode()
    assert NcclProfile.objects.filter(name="efa-p5").exists()


BLOCK = """\
Here's a practical example:
os.environ["NCCL_NET"] = "IB"
os.environ["NCCL_IB_DISABLE_CUDA_VGRAPH"] = "1"
os.environ["NCCL_PROTO"] = "Simple"
"""


def test_the_lint_page_judges_a_pasted_block(client, viewer):
    client = logged_in(client, viewer)
    assert "<h1>NCCL lint</h1>" in client.get("/nccl/lint/").content.decode()
    html = client.post("/nccl/lint/", {"text": BLOCK, "fabric": "efa"}).content.decode()
    assert "<h1>NCCL lint</h1>" in html
    assert re.findall(r'data-variable="(\w+)" data-level="(\w+)"', html) == [
        ("NCCL_NET", "error"),
        ("NCCL_IB_DISABLE_CUDA_VGRAPH", "error"),
        ("NCCL_PROTO", "error"),
    ]
    assert "did you mean <code>NCCL_NET_GDR_LEVEL</code> or <code>NCCL_IB_DISABLE</code>?" in html
    assert "1 other line set nothing" in html


def test_htmx_gets_only_the_verdicts(client, researcher):
    response = logged_in(client, researcher).post(
        "/nccl/lint/", {"text": "export NCCL_IB_TIMEOUT=60\n"}, HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="lint-results"')
    assert "<html" not in html and "outside 1..31" in html


def test_the_catalogue_page(client, viewer):
    client = logged_in(client, viewer)
    html = client.get("/nccl/variables/").content.decode()
    assert 'data-variable="NCCL_IB_TIMEOUT"' in html and 'data-variable="FI_PROVIDER"' in html
    assert "<code>NCCL_ORDER_VIA_NVLINK</code>" in html  # among the names no release reads
    torch = client.get("/nccl/variables/", {"family": "torch"}).content.decode()
    names = re.findall(r'<tr data-variable="(\w+)"', torch)
    assert names and all(n.startswith(("TORCH_", "NCCL_")) for n in names)
    assert "NCCL_ASYNC_ERROR_HANDLING" in names and "NCCL_IB_HCA" not in names


def test_the_pages_need_a_login(client):
    for url in ("/nccl/profiles/", "/nccl/lint/", "/nccl/variables/", "/nccl/profiles.csv"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_the_catalogues_code_spans_are_code_on_the_pages_not_backticks(client, viewer):
    client = logged_in(client, viewer)
    catalogue = client.get("/nccl/variables/").content.decode()
    row = re.search(r'<tr data-variable="NCCL_SOCKET_IFNAME">.*?</tr>', catalogue, re.S).group(0)
    assert "<code>^</code> to exclude, <code>=</code> for exact names" in row
    assert "`" not in catalogue

    lint = client.post("/nccl/lint/", {"text": "NCCL_SOCKET_IFNAME=eth0\n"}).content.decode()
    assert "<code>^</code> to exclude" in lint and "`" not in lint


def test_code_spans_escape_what_is_inside_and_outside_them():
    from apps.tuning.templatetags.lint_text import code_spans

    assert (
        code_spans("set `<b>` & `x`, or `")
        == "set <code>&lt;b&gt;</code> &amp; <code>x</code>, or `"
    )
    assert code_spans(None) == ""


# --- queries -------------------------------------------------------------------------------


def _more_profiles(count: int) -> None:
    """Profiles made and last changed by different ops people, several fabrics: what an N+1
    on the NCCL pages (a profile's editor, its lint) would pay for once each."""
    from apps.tuning import services
    from tests import factories

    for n in range(count):
        ops = factories.make_org_user(role="ops")
        services.nccl_profile_create(
            by=ops,
            name=f"more-{n}",
            title=f"More {n}",
            fabric=("infiniband", "efa", "roce")[n % 3],
            env={"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
        )


# The session, the user, their roles and the navigation's budget alerts, then the page's own
# read (the profiles with their editors; the linter and the catalogue read nothing); a
# profile's page also reads its versions, with their authors and tuning runs, in one query.
NCCL_PAGES = [
    ("/nccl/profiles/", "GET", 5),
    ("/nccl/profiles/ib-nvswitch-8gpu/", "GET", 6),
    ("/nccl/lint/", "GET", 4),
    ("/nccl/lint/", "POST", 4),
    ("/nccl/variables/", "GET", 4),
]


@pytest.mark.parametrize(("url", "method", "queries"), NCCL_PAGES)
def test_the_nccl_pages_make_as_many_queries_for_3_profiles_as_for_15(
    client, viewer, team, url, method, queries, django_assert_max_num_queries
):
    from tests import factories

    for _ in range(3):  # the viewer is in several teams (the navigation reads them)
        factories.make_member(team=factories.make_team(), role="viewer", user=viewer)
    logged_in(client, viewer)
    body = {"text": "export NCCL_IB_TIMEOUT=60\nNCCL_DEBUG=INFO\n", "fabric": "infiniband"}

    def ask():
        answer = client.post(url, body) if method == "POST" else client.get(url)
        assert answer.status_code == 200
        return answer.content.decode()

    ask()  # warm
    with django_assert_max_num_queries(queries) as few:
        ask()
    _more_profiles(12)
    with django_assert_max_num_queries(len(few.captured_queries)):
        html = ask()
    if url == "/nccl/profiles/":
        assert len(rows_of(html, "data-profile")) == 15
