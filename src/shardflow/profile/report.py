"""One self-contained HTML report of a capture: diagnosis, step-time bars, memory over time, top ops."""

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
from shardflow.profile.diagnose import CATEGORIES, diagnose, steps, summarize
from shardflow.profile.trace import role_sort_key

COLORS = {
    "input_wait": "#e4572e",
    "compute": "#4c72b0",
    "communication": "#f3a712",
    "ps_apply": "#29a329",
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
"""


def write_report(table: pa.Table, out_path: str | Path, title: str = "shardflow profile") -> Path:
    """Plots are PNGs inlined as data URIs, so the file opens anywhere without a network."""
    import matplotlib

    matplotlib.use("Agg")
    num_steps = len(set(table["step"].drop_null().to_pylist()))
    roles = sorted(set(table["role"].to_pylist()), key=role_sort_key)
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{num_steps} global steps, {len(roles)} roles: {html.escape(", ".join(roles))}</p>',
        *_diagnosis_section(table),
        *_steps_section(table),
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

    figure, axes = plt.subplots(figsize=(11, 0.45 * len(summaries) + 1.4))
    labels = [s.role for s in summaries][::-1]
    left = [0.0] * len(labels)
    for part in (*CATEGORIES, "idle"):
        widths = [s.parts_us[part] / 1000 for s in summaries][::-1]
        axes.barh(labels, widths, left=left, color=COLORS[part], label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_xlabel("ms per global step")
    axes.legend(ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(labels) < 4 else -0.12), frameon=False)
    figure.tight_layout()
    return figure


def _has_memory(table: pa.Table) -> bool:
    return bool(pc.any(pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "memory."))).as_py())


def _memory_lines(table: pa.Table) -> Any:
    import matplotlib.pyplot as plt

    memory = pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "memory."))
    counters = table.filter(memory).select(["role", "name", "ts", "value"]).to_pylist()
    names = sorted({c["name"] for c in counters})
    origin = min(c["ts"] for c in counters)
    figure, all_axes = plt.subplots(len(names), 1, figsize=(11, 2.4 * len(names)), squeeze=False, sharex=True)
    for axes, name in zip(all_axes[:, 0], names, strict=True):
        for role in sorted({c["role"] for c in counters if c["name"] == name}, key=role_sort_key):
            series = [(c["ts"], c["value"]) for c in counters if c["name"] == name and c["role"] == role]
            axes.step([(t - origin) / 1000 for t, _ in series], [v / 1e6 for _, v in series], where="post", label=role)
        axes.set_title(name, fontsize=10, loc="left")
        axes.set_ylabel("MB")
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    all_axes[-1, 0].set_xlabel("ms since the capture's first event")
    figure.tight_layout()
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
