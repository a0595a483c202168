"""Line and stacked bar charts drawn as SVG on the server: pictures where people would rather
look than read.

No JavaScript and no chart library: the page gets finished markup (like the rack
elevations), which also prints, and reads without scripts. Used for training
curves, and spend by day on the Costs page.
"""

import html
import math
from collections.abc import Callable, Collection, Mapping, Sequence

from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

# Series colours, in order (the newest series is drawn last, on top).
PALETTE = ("#94a3b8", "#64748b", "#0ea5e9", "#2563eb", "#7c3aed", "#db2777")
# For series of equal standing (jobs compared): colours told apart at a glance, none grey.
DISTINCT = ("#2563eb", "#db2777", "#f59e0b", "#10b981", "#7c3aed", "#0ea5e9")


# Spans below these are drawn as flat: below the first, a step of 10^k would be past what
# floats hold (10 ** -324 is 0.0); below the second (relative to the values), ticks would
# differ by less than their 12 significant digits show.
_FLAT = 1e-290
_FLAT_RELATIVE = 1e-9


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values covering [low, high] (steps of 1, 2 or 5 × 10^k)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if not high - low >= max(_FLAT, _FLAT_RELATIVE * max(abs(low), abs(high))):
        high = low + (abs(low) if abs(low) >= _FLAT else 1.0)  # one value, in effect: widen
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    ticks = [math.floor(low / step) * step]
    while ticks[-1] < high - step * 1e-9:
        ticks.append(ticks[0] + step * len(ticks))
    return [float(f"{t:.12g}") for t in ticks]  # without float noise (0.30000000000000004)


def compact_number(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    y_format: Callable[[float], str] = compact_number,
    x_format: Callable[[float], str] = compact_number,
    width: int = 520,
    height: int = 200,
    colours: Sequence[str] | None = None,
    legend: bool = True,
    bold: Collection[str] = (),
    marked: Mapping[str, Sequence[str]] | None = None,
) -> SafeString:
    """One SVG with a line per series; the series' names make the legend (unless `legend` is
    off: the page has one of its own). `colours`: one per series, in order (series_colours);
    by default the newest series, last, is the boldest and the older ones grey. The series
    named in `bold` are drawn thicker (a reference the others are read against). The series
    named in `marked` get a dot at each point, whose tooltip is the text given for that
    point (one per point, in order): sparse points (evaluations) show even alone."""
    points = [p for values in series.values() for p in values if math.isfinite(p[1])]
    if not points:
        return format_html('<p class="empty chart-empty">{}: no data yet.</p>', title)
    left, right, top, bottom = 56, 12, 24, 28
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    x_low, x_high = min(xs), max(xs)
    y_ticks = nice_ticks(min(ys), max(ys))
    y_low, y_high = y_ticks[0], y_ticks[-1]
    if x_high == x_low:
        x_high = x_low + 1

    def px(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * plot_w

    def py(y: float) -> float:
        return top + plot_h - (y - y_low) / ((y_high - y_low) or 1) * plot_h

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text class="chart-title" x="{left}" y="14">{escape(title)}</text>',
    ]
    for tick in y_ticks:
        y = py(tick)
        parts.append(
            f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(y_format(tick))}</text>"
        )
    for tick in nice_ticks(x_low, x_high, 6):
        if x_low <= tick <= x_high:
            parts.append(
                f'<text class="tick" x="{px(tick):.1f}" y="{height - 8}" text-anchor="middle">'
                f"{escape(x_format(tick))}</text>"
            )
    names = list(series)
    for i, name in enumerate(names):
        values = [(x, y) for x, y in series[name] if math.isfinite(y)]
        if not values:
            continue
        colour = (
            colours[i % len(colours)]
            if colours
            else PALETTE[(len(PALETTE) - len(names) + i) % len(PALETTE)]
        )
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in values)
        thick = name in bold
        parts.append(
            f'<polyline class="series{" bold" if thick else ""}" fill="none" stroke="{colour}" '
            f'stroke-width="{3.2 if thick else 1.6}" '
            f'points="{path}"><title>{escape(name)}</title></polyline>'
        )
        titles = (marked or {}).get(name)
        if titles is not None:
            for (x, y), text in zip(series[name], titles, strict=True):
                if math.isfinite(y):
                    parts.append(
                        f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" '
                        f'fill="{colour}"><title>{escape(text)}</title></circle>'
                    )
        if legend and len(names) > 1:  # the legend, right-aligned along the top
            x = left + plot_w - 80 * (len(names) - 1 - i)
            parts.append(
                f'<text class="legend" x="{x}" y="14" text-anchor="end" fill="{colour}">'
                f"{escape(name)}</text>"
            )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 (every text above is escaped)


def swatch(colour: str) -> SafeString:
    """A small square of a series' colour, for a legend written in the page (an SVG: the
    page's policy refuses style attributes)."""
    return format_html(
        '<svg class="swatch" width="12" height="12" aria-hidden="true">'
        '<rect width="12" height="12" fill="{}"/></svg>',
        colour,
    )


# Colours for stacked bars, one per group (a group keeps its colour across days).
STACK_PALETTE = ("#2563eb", "#0ea5e9", "#7c3aed", "#db2777", "#f59e0b", "#10b981", "#94a3b8")


def stacked_bar_chart(
    columns: Sequence,
    series: Mapping[str, Mapping],
    *,
    title: str,
    y_format: Callable[[float], str] = compact_number,
    x_label: Callable[[object], str] = str,
    width: int = 720,
    height: int = 240,
) -> SafeString:
    """One bar per column (a day), stacked by series (a team, a pool...), in the order given.

    `series` maps a name to {column: value}; missing values are zero. Each segment has a
    <title> (name, column and value) for a reader hovering over it.
    """
    # Each bar's height: what is drawn, its values above zero (a day's value below zero, a
    # correction larger than the spend, is left out rather than drawn downwards).
    heights = [
        sum(max(float(values.get(c, 0) or 0), 0.0) for values in series.values()) for c in columns
    ]
    if not columns or not any(heights):
        return format_html('<p class="empty chart-empty">{}: no data yet.</p>', title)
    left, right, top, bottom = 64, 12, 24, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    y_ticks = nice_ticks(0.0, max(heights))
    y_high = y_ticks[-1] or 1.0
    slot = plot_w / len(columns)
    bar = max(slot * 0.72, 1.0)

    def py(y: float) -> float:
        return top + plot_h - y / y_high * plot_h

    parts = [
        f'<svg class="chart stacked" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text class="chart-title" x="{left}" y="14">{escape(title)}</text>',
    ]
    for tick in y_ticks:
        y = py(tick)
        parts.append(
            f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(y_format(tick))}</text>"
        )
    names = list(series)
    colours = {name: STACK_PALETTE[i % len(STACK_PALETTE)] for i, name in enumerate(names)}
    every = max(1, -(-len(columns) // 12))  # at most a dozen labels along the bottom
    for i, column in enumerate(columns):
        x = left + i * slot + (slot - bar) / 2
        base = 0.0
        for name in names:
            value = float(series[name].get(column, 0) or 0)
            if value <= 0:
                continue
            y_top, y_bottom = py(base + value), py(base)
            parts.append(
                f'<rect class="segment" x="{x:.1f}" y="{y_top:.1f}" width="{bar:.1f}" '
                f'height="{max(y_bottom - y_top, 0.5):.1f}" fill="{colours[name]}">'
                f"<title>{escape(name)} · {escape(x_label(column))}: "
                f"{escape(y_format(value))}</title></rect>"
            )
            base += value
        if i % every == 0:
            parts.append(
                f'<text class="tick" x="{x + bar / 2:.1f}" y="{top + plot_h + 14}" '
                f'text-anchor="middle">{escape(x_label(column))}</text>'
            )
    for i, name in enumerate(names):  # the legend, along the bottom
        x = left + i * 110
        if x + 100 > width:
            break
        parts.append(
            f'<rect x="{x}" y="{height - 14}" width="10" height="10" fill="{colours[name]}"/>'
            f'<text class="legend" x="{x + 14}" y="{height - 5}">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 (every text above is escaped)


def heat_grid(groups: Sequence[tuple[str, str, Sequence[tuple[str, str, str]]]]) -> SafeString:
    """A heat map of small linked cells in labelled groups (a node and its GPUs).

    `groups`: (label, href, cells), each cell (css classes, href, label); the classes say
    the cell's colour (the stylesheet's `heat-0` … `heat-10`), the label is its tooltip and
    accessible name. Built here rather than in a template loop: a fleet has thousands.
    """
    # html.escape (quotes too) rather than format_html per cell: 80,000 cells are a lot; and
    # classes and links, the same for many cells, escaped once each.
    quote = html.escape
    quoted: dict[str, str] = {}

    def quote_once(text: str) -> str:
        out = quoted.get(text)
        if out is None:
            out = quoted[text] = quote(text)
        return out

    parts = ['<div class="heat-map">']
    for label, href, cells in groups:
        parts.append(
            f'<div class="heat-node"><a class="heat-name" href="{quote(href)}">{quote(label)}</a>'
            '<span class="heat-cells">'
        )
        for classes, cell_href, cell_label in cells:
            text = quote(cell_label)
            parts.append(
                f'<a class="heat-cell {quote_once(classes)}" href="{quote_once(cell_href)}" '
                f'title="{text}" aria-label="{text}"></a>'
            )
        parts.append("</span></div>")
    parts.append("</div>")
    return mark_safe("".join(parts))  # noqa: S308 (every text above is escaped)


RACK_UNIT_PX = 14  # one rack unit's height on the drawing


def rack_elevation(
    *, label: str, height_units: int, units: Sequence[tuple[int, str, str, str, str]]
) -> SafeString:
    """A rack's front drawn as SVG: its numbered units, and what sits in them.

    `units`: (unit, css classes, title, href, text), drawn in order (a later one on top);
    units count from 1 at the bottom. Built here rather than in a template loop: a page
    draws several racks of 42 units.
    """
    quote = html.escape
    rack_px = height_units * RACK_UNIT_PX
    parts = [
        f'<svg class="elevation" role="img" aria-label="Elevation of rack {quote(label)}" '
        f'width="190" height="{rack_px + 16}" viewBox="0 0 190 {rack_px + 16}">'
        f'<rect class="rack-frame" x="0" y="0" width="190" height="{rack_px + 16}" rx="4"/>'
        # Inside the translated group a thing in unit u sits at y = -14u.
        f'<g transform="translate(26 {rack_px + 8})">'
    ]
    for unit in range(1, height_units + 1):
        parts.append(
            f'<g transform="translate(0 -{unit * RACK_UNIT_PX})">'
            '<rect class="slot" x="0" y="0.5" width="150" height="13"/>'
            f'<text class="unit-number" x="-6" y="10">{unit}</text></g>'
        )
    for unit, classes, title, href, text in units:
        parts.append(
            f'<g class="{quote(classes)}" transform="translate(0 -{unit * RACK_UNIT_PX})">'
            f"<title>{quote(title)}</title>"
            '<rect x="0" y="0.5" width="150" height="13" rx="2"/>'
            f'<a href="{quote(href)}"><text x="6" y="10">{quote(text)}</text></a></g>'
        )
    parts.append("</g></svg>")
    return mark_safe("".join(parts))  # noqa: S308 (every text above is escaped)
