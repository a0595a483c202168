"""Server-drawn SVG charts: round ticks covering the data, escaped text, no data said plainly."""

import itertools
import re

from hypothesis import example, given
from hypothesis import strategies as st

from controlplane.charts import (
    DISTINCT,
    PALETTE,
    heat_grid,
    line_chart,
    nice_ticks,
    rack_elevation,
    stacked_bar_chart,
    swatch,
)

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)


@given(finite, finite)
@example(0.0, 5e-324)  # a span below float's normal range (found by hypothesis)
@example(-1e-300, 1e-300)
@example(1e9, 1e9 + 1e-6)  # a span below what 12 significant digits show
def test_ticks_cover_the_range_in_round_ascending_steps(a, b):
    low, high = min(a, b), max(a, b)
    ticks = nice_ticks(low, high)
    assert ticks == sorted(set(ticks)) and len(ticks) >= 2  # strictly ascending
    slack = 1e-6 * (ticks[1] - ticks[0])  # what is invisible on a chart of this scale
    assert ticks[0] <= low + slack
    assert ticks[-1] >= high - slack
    steps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(steps) - min(steps) <= 1e-6 * max(steps)  # one step, rounding aside


def test_a_chart_draws_one_line_per_series_and_escapes_text():
    svg = str(
        line_chart(
            {"attempt 1": [(1, 3.0), (2, 2.5)], "attempt <2>": [(2, 2.6), (3, 2.2)]},
            title="Loss & <script>",
        )
    )
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "attempt &lt;2&gt;" in svg
    xs = [float(p.split(",")[0]) for p in re.findall(r'points="([^"]+)"', svg)[0].split()]
    assert xs == sorted(xs)  # drawn left to right by step


def test_series_of_equal_standing_take_the_colours_given_and_the_page_keeps_the_legend():
    series = {f"#{i} run": [(1, 3.0 + i), (2, 2.0 + i)] for i in range(3)}
    svg = str(line_chart(series, title="Loss", colours=DISTINCT, legend=False))
    assert re.findall(r'<polyline[^>]*stroke="([^"]+)"', svg) == list(DISTINCT[:3])
    assert 'class="legend"' not in svg and "<title>#2 run</title>" in svg
    assert 'fill="#2563eb"' in str(swatch(DISTINCT[0]))
    # Without colours, the newest series (drawn last) is the boldest, and the legend is drawn.
    svg = str(line_chart(series, title="Loss"))
    assert re.findall(r'stroke="([^"]+)"', svg)[-1] == PALETTE[-1]
    assert svg.count('class="legend"') == 3


def test_no_data_is_said_in_words():
    assert "no data yet" in str(line_chart({}, title="Loss"))


money = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(st.lists(money, min_size=3, max_size=3), min_size=1, max_size=4))
def test_stacked_bars_stay_inside_the_plot_with_corrections_below_zero(rows):
    # A team's day can be negative (finance's correction); only what is above zero is drawn.
    days = [1, 2, 3]
    series = {f"team {i}": dict(zip(days, row, strict=True)) for i, row in enumerate(rows)}
    svg = str(stacked_bar_chart(days, series, title="Spend"))
    if "no data yet" in svg:
        assert all(value <= 0 for row in rows for value in row)
        return
    top, bottom = 24, 240 - 44  # the plot's edges in the chart's default size
    for y, height in re.findall(
        r'class="segment" x="[^"]+" y="([^"]+)" width="[^"]+" '
        r'height="([^"]+)"',
        svg,
    ):
        assert top - 0.05 <= float(y) and float(y) + float(height) <= bottom + 0.55


@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 10**6), finite), min_size=1, max_size=6),
        min_size=1,
        max_size=3,
    )
)
def test_every_point_of_a_line_chart_is_inside_its_plot(lines):
    svg = str(line_chart({f"run {i}": line for i, line in enumerate(lines)}, title="Loss"))
    left, top, right, bottom = 56, 24, 520 - 12, 200 - 28  # the default size's plot
    for points in re.findall(r'points="([^"]+)"', svg):
        for point in points.split():
            x, y = map(float, point.split(","))
            assert left - 0.05 <= x <= right + 0.05 and top - 0.05 <= y <= bottom + 0.05


def test_a_heat_grid_links_each_cell_and_escapes_what_it_is_given():
    html = heat_grid(
        [
            ("n<1>", "/fleet/nodes/1/", [("heat-3 held", "/fleet/nodes/1/", 'GPU 0 · job "x"')]),
            ("n2", "/fleet/nodes/2/", []),
        ]
    )
    assert '<a class="heat-name" href="/fleet/nodes/1/">n&lt;1&gt;</a>' in html
    assert (
        '<a class="heat-cell heat-3 held" href="/fleet/nodes/1/" '
        'title="GPU 0 · job &quot;x&quot;" aria-label="GPU 0 · job &quot;x&quot;"></a>'
    ) in html
    assert html.count('class="heat-node"') == 2


def test_a_rack_elevation_numbers_its_units_and_places_what_it_is_given_escaped():
    html = rack_elevation(
        label="R<1>",
        height_units=4,
        units=[(3, "unit state-ready", 'n1 · "ready"', "/fleet/nodes/1/", "n1<")],
    )
    assert 'aria-label="Elevation of rack R&lt;1&gt;" width="190" height="72"' in html
    assert html.count('<rect class="slot"') == 4
    assert '<text class="unit-number" x="-6" y="10">4</text>' in html
    assert (
        '<g class="unit state-ready" transform="translate(0 -42)">'
        "<title>n1 · &quot;ready&quot;</title>"
    ) in html
    assert '<a href="/fleet/nodes/1/"><text x="6" y="10">n1&lt;</text></a>' in html


def test_a_line_chart_labels_its_x_axis_as_asked():
    html = line_chart(
        {"mean": [(-60.0, 1.0), (0.0, 2.0)]}, title="t", x_format=lambda x: f"{x:g} min"
    )
    assert ">-40 min</text>" in html
