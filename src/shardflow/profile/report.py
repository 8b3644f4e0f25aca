"""One self-contained HTML report of a capture: diagnosis, step-time bars, every role's timeline, memory over time,
top ops."""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardflow.profile.analysis import memory, top
from shardflow.profile.diagnose import CATEGORIES, diagnose, global_steps, steps, summarize
from shardflow.profile.events import trace_metadata
from shardflow.profile.timeline import STEP_COLOR, capture_span_us, timeline_svg
from shardflow.profile.trace import role_sort_key

COLORS = {
    "input_wait": "#e4572e",
    "compute": "#4c72b0",
    "communication": "#f3a712",
    "apply": "#29a329",
    "other": "#8e6c8a",
    "idle": "#c8c8c8",
}
_NUMBER = re.compile(r"[-+]?[\d.,]+( ?(%|[KMG]?B))?|-")
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.meta { color: #666; font-size: 13px; }
.finding { padding: 8px 12px; margin: 6px 0; border-left: 4px solid #bbb; background: #f6f6f6; }
.finding.first { border-color: #e4572e; background: #fdf0ec; font-weight: 600; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; text-align: left; }
th { background: #f0f0f0; } .num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; }
.swatch { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }
"""


def write_report(table: pa.Table, out_path: str | Path, title: str = "shardflow profile") -> Path:
    """Plots are PNGs inlined as data URIs and the timeline an inline SVG, so the file opens anywhere without a
    network."""
    import matplotlib

    matplotlib.use("Agg")
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        _header(table),
        *_diagnosis_section(table),
        *_steps_section(table),
        *_timeline_section(table),
        *_memory_section(table),
        *_top_section(table),
    ]
    document = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )
    out_path = Path(out_path)
    out_path.write_text(document, encoding="utf-8")
    return out_path


def _header(table: pa.Table) -> str:
    """The global steps the capture asked for (every role records the same ones), its length, and every role."""
    recorded = trace_metadata(table).get("roles", {})
    asked = {(info.get("first_step"), info.get("last_step")) for info in recorded.values()} - {(None, None)}
    if len(asked) == 1:
        ((first, last),) = asked
        num_steps, which = last - first, f"{first}" if last - first == 1 else f"{first} to {last - 1}"
    else:  # a table without its trace's metadata
        held = global_steps(table)
        num_steps, which = len(held), f"{held[0]} to {held[-1]}" if held else "none"
    start_us, end_us = capture_span_us(table)
    with_events = set(pc.unique(table["role"]).to_pylist())
    roles = [
        role if role in with_events else f"{role} (no events)"
        for role in sorted(set(recorded) | with_events, key=role_sort_key)
    ]
    return (
        f'<p class="meta">{num_steps} global step{"" if num_steps == 1 else "s"} ({which}) over '
        f"{(end_us - start_us) / 1000:.1f} ms; {len(roles)} roles: {html.escape(', '.join(roles))}</p>"
    )


def _diagnosis_section(table: pa.Table) -> list[str]:
    """The first finding, highlighted, and any other that explains at least a quarter of the step."""
    return [
        "<h2>Diagnosis</h2>",
        *(
            f'<div class="finding{" first" if i == 0 else ""}">{html.escape(f.message)}</div>'
            for i, f in enumerate(diagnose(table))
            if i == 0 or f.fraction >= 0.25
        ),
    ]


def _steps_section(table: pa.Table) -> list[str]:
    summaries = sorted(summarize(steps(table)), key=lambda s: role_sort_key(s.role))
    rows = [
        [s.role, s.num_steps, f"{s.step_us / 1000:.3f}", *(f"{s.fraction(p):.0%}" for p in (*CATEGORIES, "idle"))]
        for s in summaries
    ]
    return [
        "<h2>Step time per role (mean per global step)</h2>",
        _image(_step_bars(summaries)),
        _table(["role", "steps", "step ms", *CATEGORIES, "idle"], rows),
    ]


def _timeline_section(table: pa.Table) -> list[str]:
    swatches = [(STEP_COLOR, "step"), *((COLORS[part], part.replace("_", " ")) for part in CATEGORIES)]
    legend = "".join(f'<span class="swatch" style="background:{color}"></span>{name}' for color, name in swatches)
    return [
        "<h2>Timeline</h2>",
        f'<p class="meta">Every role\'s spans over the capture, a lane per thread; hover a span for its name, step '
        f"and duration.{legend}</p>",
        timeline_svg(table, COLORS),
    ]


def _memory_section(table: pa.Table) -> list[str]:
    rows = [
        [
            p.role,
            p.counter,
            _size(p.peak),
            p.step if p.step is not None else "-",
            " > ".join(p.active),
            f"{_size(p.live[0].bytes)} from {p.live[0].op} {p.live[0].shape}" if p.live else "",
        ]
        for p in memory(table)
    ]
    return [
        "<h2>Memory over time</h2>",
        _image(_memory_lines(table)) if _has_memory(table) else "<p>No memory counters in this capture.</p>",
        _table(["role", "counter", "peak", "step", "running at the peak", "largest live at the peak"], rows),
    ]


def _top_section(table: pa.Table) -> list[str]:
    top_rows = top(table, shown=_ops_if_any(table))[:15]
    rows = [
        [r.key, r.calls, f"{r.self_value / 1000:.3f}", f"{r.total_value / 1000:.3f}", f"{r.share:.1%}"]
        for r in top_rows
    ]
    return [
        "<h2>Top by self time</h2>",
        _image(_top_bars(top_rows)),
        _table(["name", "calls", "self ms", "total ms", "share"], rows),
    ]


def _ops_if_any(table: pa.Table) -> Any:
    """Top shows torch ops when the capture has them, else the recorder's spans."""
    if pc.any(pc.equal(table["cat"], "op")).as_py():
        return lambda t: pc.fill_null(pc.equal(t["cat"], "op"), False).to_numpy(zero_copy_only=False)
    return None


def _step_bars(summaries: list[Any]) -> Any:
    import matplotlib.pyplot as plt

    # Constrained layout makes room for the legend above the bars, so that nothing covers the axis label.
    figure, axes = plt.subplots(figsize=(11, 0.45 * len(summaries) + 1.6), layout="constrained")
    labels = [s.role for s in summaries][::-1]
    left = [0.0] * len(labels)
    for part in (*CATEGORIES, "idle"):
        widths = [s.parts_us[part] / 1000 for s in summaries][::-1]
        axes.barh(labels, widths, left=left, color=COLORS[part], label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_xlabel("ms per global step")
    figure.legend(ncol=6, loc="outside upper center", frameon=False)
    return figure


def _has_memory(table: pa.Table) -> bool:
    return bool(pc.any(pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "memory."))).as_py())


def _memory_lines(table: pa.Table) -> Any:
    import matplotlib.pyplot as plt

    memory = pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "memory."))
    counters = table.filter(memory).select(["role", "name", "ts", "value"]).to_pylist()
    names = sorted({c["name"] for c in counters})
    # The whole capture on the x axis, as on the timeline: a role samples only while it records, and its samples
    # (the dots) sit where they were taken.
    start_us, end_us = capture_span_us(table)
    figure, all_axes = plt.subplots(
        len(names), 1, figsize=(11, 2.4 * len(names)), squeeze=False, sharex=True, layout="constrained"
    )
    for axes, name in zip(all_axes[:, 0], names, strict=True):
        for role in sorted({c["role"] for c in counters if c["name"] == name}, key=role_sort_key):
            series = [(c["ts"], c["value"]) for c in counters if c["name"] == name and c["role"] == role]
            times, values = [(t - start_us) / 1000 for t, _ in series], [v / 1e6 for _, v in series]
            axes.step(times, values, where="post", marker=".", label=role)
        axes.set_title(name, fontsize=10, loc="left")
        axes.set_ylabel("MB")
        axes.set_xlim(0, (end_us - start_us) / 1000)
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    all_axes[-1, 0].set_xlabel("ms since the capture's first event")
    return figure


def _top_bars(rows: list[Any]) -> Any:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.0))
    axes.barh([r.key for r in rows][::-1], [r.self_value / 1000 for r in rows][::-1], color="#4c72b0")
    axes.set_xlabel("self time, ms (hidden children rolled up)")
    figure.tight_layout()
    return figure


def _image(figure: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    numeric = [bool(rows) and all(_NUMBER.fullmatch(str(row[i])) for row in rows) for i in range(len(header))]
    head = "".join(_cell("th", str(h).replace("_", " "), numeric[i]) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(_cell("td", v, numeric[i]) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(tag: str, value: Any, numeric: bool) -> str:
    attribute = ' class="num"' if numeric else ""
    return f"<{tag}{attribute}>{html.escape(str(value))}</{tag}>"


def _size(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"
