"""Server-drawn SVG charts: round ticks covering the data, escaped text, no data said plainly."""

import itertools
import re

from hypothesis import example, given
from hypothesis import strategies as st

from controlplane.charts import line_chart, nice_ticks

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


def test_no_data_is_said_in_words():
    assert "no data yet" in str(line_chart({}, title="Loss"))
