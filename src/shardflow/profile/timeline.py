"""Every role's spans over the capture's time, drawn as an inline SVG: the report's timeline, which needs no viewer
and no network. A lane per thread that recorded spans; nested spans (forward inside step) stack downwards."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardflow.profile.diagnose import CATEGORY
from shardflow.profile.events import trace_metadata
from shardflow.profile.spans import STEP
from shardflow.profile.trace import role_sort_key

MAX_SPANS = 20_000
"""More spans than this keep the longest: the file stays a few MB, and a span narrower than a pixel shows nothing."""
LABEL_WIDTH, PLOT_WIDTH, AXIS_HEIGHT = 150, 1000, 22
ROW_HEIGHT, LANE_GAP, MAX_DEPTH = 12, 6, 4
STEP_COLOR, OTHER_COLOR = "#e6e6e6", "#8e6c8a"


def capture_span_us(table: pa.Table) -> tuple[float, float]:
    """The capture's first and last moment (µs on the merged trace's clock): every event, counters included."""
    if table.num_rows == 0:
        return 0.0, 0.0
    ends = pc.add(table["ts"], pc.fill_null(table["dur"], 0.0))
    return float(pc.min(table["ts"]).as_py()), float(pc.max(ends).as_py())


def timeline_svg(table: pa.Table, colors: Mapping[str, str]) -> str:
    """The SVG of every role's spans (torch ops left out: the recorder's spans say where a step's time goes); a span
    is colored by its part of the step (`colors` maps diagnose's CATEGORIES to colors), a step span is the grey
    band under its parts, and each span's tooltip gives its name, step and duration."""
    start_us, end_us = capture_span_us(table)
    scale = PLOT_WIDTH / max(end_us - start_us, 1.0)
    spans = _spans(table)
    lanes = _lanes(spans, _roles(table))
    parts: list[str] = []
    y = AXIS_HEIGHT
    for label, lane in lanes:
        depths = _depths(lane)
        height = ROW_HEIGHT * (min(max(depths, default=0), MAX_DEPTH - 1) + 1)
        parts.append(f'<text x="{LABEL_WIDTH - 6}" y="{y + 10}" text-anchor="end">{html.escape(label)}</text>')
        if not lane:
            parts.append(f'<text x="{LABEL_WIDTH + 4}" y="{y + 10}" fill="#999">no spans in the capture</text>')
        for span, depth in zip(lane, depths, strict=True):
            row = min(depth, MAX_DEPTH - 1)
            x = LABEL_WIDTH + (span["ts"] - start_us) * scale
            color = STEP_COLOR if span["name"] == STEP else colors.get(CATEGORY.get(span["name"], ""), OTHER_COLOR)
            tooltip = (
                f"{span['role']} {span['name']}, step {span['step']}: {span['dur'] / 1000:.3f} ms "
                f"at {(span['ts'] - start_us) / 1000:.3f} ms"
            )
            parts.append(
                f'<rect x="{x:.2f}" y="{y + row * ROW_HEIGHT + 1}" width="{max(span["dur"] * scale, 0.5):.2f}" '
                f'height="{ROW_HEIGHT - 2}" fill="{color}"><title>{html.escape(tooltip)}</title></rect>'
            )
        y += height + LANE_GAP
    axis = _axis((end_us - start_us) / 1000, y)
    width = LABEL_WIDTH + PLOT_WIDTH + 20
    return (
        f'<svg viewBox="0 0 {width} {y + 4}" width="100%" '
        f'font-family="system-ui, sans-serif" font-size="11">{axis}{"".join(parts)}</svg>'
    )


def _spans(table: pa.Table) -> list[dict[str, Any]]:
    """The complete spans (ph X) that are not torch ops, the longest MAX_SPANS of them."""
    keep = pc.and_(pc.equal(table["ph"], "X"), pc.invert(pc.fill_null(pc.equal(table["cat"], "op"), False)))
    spans = table.filter(keep).select(["role", "thread", "name", "step", "ts", "dur"])
    if spans.num_rows > MAX_SPANS:
        longest = pc.select_k_unstable(spans, MAX_SPANS, [("dur", "descending")])
        spans = spans.take(longest)
    rows: list[dict[str, Any]] = spans.to_pylist()
    return rows


def _roles(table: pa.Table) -> list[str]:
    """Every role of the capture, those that recorded nothing too, chief first."""
    named = set(trace_metadata(table).get("roles", {})) | set(pc.unique(table["role"]).to_pylist())
    return sorted(named, key=role_sort_key)


def _lanes(spans: Iterable[dict[str, Any]], roles: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, spans by start) per thread that recorded spans, each role's together; a role without any gets one
    empty lane. A role with one such thread is labelled by the role alone."""
    by_thread: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for span in spans:
        by_thread.setdefault((span["role"], span["thread"]), []).append(span)
    lanes: list[tuple[str, list[dict[str, Any]]]] = []
    for role in roles:
        threads = sorted(thread for owner, thread in by_thread if owner == role)
        if not threads:
            lanes.append((role, []))
        for thread in threads:
            lane = sorted(by_thread[(role, thread)], key=lambda span: (span["ts"], -span["dur"]))
            lanes.append((role if len(threads) == 1 else f"{role} {thread}", lane))
    return lanes


def _depths(lane: list[dict[str, Any]]) -> list[int]:
    """How many spans of the lane (sorted by start, longest first) enclose each span."""
    open_ends: list[float] = []
    depths = []
    for span in lane:
        while open_ends and open_ends[-1] <= span["ts"]:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(span["ts"] + span["dur"])
    return depths


def _axis(span_ms: float, bottom: float) -> str:
    """Ticks every 1, 2 or 5 times a power of ten ms, about ten across, with grid lines down to `bottom`."""
    rough = max(span_ms / 10, 1e-3)
    power = 10 ** math.floor(math.log10(rough))
    tick_ms = next(step * power for step in (1, 2, 5, 10) if step * power >= rough)
    scale = PLOT_WIDTH / max(span_ms, 1e-3)
    ticks = []
    for index in range(int(span_ms / tick_ms) + 1):
        x = LABEL_WIDTH + index * tick_ms * scale
        ticks.append(
            f'<line x1="{x:.2f}" y1="{AXIS_HEIGHT - 4}" x2="{x:.2f}" y2="{bottom}" stroke="#eee"/>'
            f'<text x="{x:.2f}" y="{AXIS_HEIGHT - 8}" text-anchor="middle" fill="#666">{index * tick_ms:g}</text>'
        )
    label = f'<text x="{LABEL_WIDTH - 6}" y="{AXIS_HEIGHT - 8}" text-anchor="end" fill="#666">ms</text>'
    return label + "".join(ticks)
