"""The scale table, its explanation in words, a PNG plot and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path

from shardflow.planning.scaling import SizeRow
from shardflow.planning.target import Target

HEADER = ("workers", "sec/step per worker", "global_step/s", "steps to target", "time to target")


def table_rows(rows: Sequence[SizeRow], target: Target | None) -> list[list[str]]:
    """The header (the last column is the target's metric, or the loss) and one line per cluster size."""
    lines = [[*HEADER, f"final {target.metric if target else 'loss'}"]]
    for row in rows:
        lines.append(
            [
                str(row.num_workers),
                f"{row.sec_per_step:.4f}",
                f"{row.global_steps_per_s:.1f}",
                str(row.target_step) if row.target_step is not None else ("not reached" if target else "-"),
                f"{row.target_s:.2f} s" if row.target_s is not None else ("not reached" if target else "-"),
                f"{row.final_metric:.4g}" if row.final_metric is not None else "-",
            ]
        )
    return lines


def explain(rows: Sequence[SizeRow], target: Target | None, batch_size: int | None) -> list[str]:
    """Paragraphs: batch per worker and per global step, staleness, speed-up, target, and where the time went."""
    first = rows[0]
    paragraphs = [_batch(rows, first.mode, batch_size)]
    if first.mode != "sync":
        staleness = ", ".join(f"{r.num_workers - 1} with {_workers(r.num_workers)}" for r in rows)
        paragraphs.append(
            f"Staleness: a worker's gradient is applied after about N-1 updates from the others ({staleness});"
            " when push overlaps the next step's compute (the async default) it is one round more, about 2N-1."
            " Stale gradients are why more workers can need more global steps to reach the same target."
        )
    paragraphs.append(_speed(rows))
    if target is not None:
        paragraphs.append(_target(rows, target))
    paragraphs.extend(_time(row) for row in rows if row.breakdown is not None)
    cores = os.cpu_count() or 1
    crowded = [r.num_workers for r in rows if r.num_workers + r.num_ps > cores]
    if crowded:
        paragraphs.append(
            f"All runs were local, on {cores} CPU cores: from {_workers(crowded[0])} on, the workers and {first.num_ps}"
            " PS outnumber the cores and share them, which caps the speed-up here but not on a real cluster;"
            f" `shardflow plan --cores {cores}` models this."
        )
    return paragraphs


def _batch(rows: Sequence[SizeRow], mode: str, batch_size: int | None) -> str:
    per_worker = f"{batch_size} examples" if batch_size else "its batch of B examples (--batch-size B gives numbers)"
    text = f"Batch: each worker trains on its own shard, {per_worker} per step. "
    if mode == "sync":
        grows = [f"{r.num_workers * batch_size} with {_workers(r.num_workers)}" for r in rows] if batch_size else []
        return text + (
            "In sync mode one global step averages the gradients of all N workers, so the effective batch per global"
            f" step is N x B ({', '.join(grows) or 'it grows with N'}); updates are not stale, and the slowest"
            " worker sets the pace."
        )
    return text + (
        f"In {mode} mode every worker's update is one global step, so the effective batch per global step stays"
        f" {batch_size or 'B'} at every size: N workers make N times as many updates, not larger ones."
    )


def _speed(rows: Sequence[SizeRow]) -> str:
    base = rows[0]
    parts = []
    for row in rows[1:]:
        speedup = row.global_steps_per_s / base.global_steps_per_s
        ideal = row.num_workers / base.num_workers
        parts.append(
            f"{_workers(row.num_workers)} reach {speedup:.2f}x the global steps/s of {base.num_workers}"
            f" (ideal {ideal:g}x; {speedup / ideal:.0%} efficiency), each worker step taking"
            f" {row.sec_per_step / base.sec_per_step:.2f}x as long"
        )
    return "Speed: " + ("; ".join(parts) + "." if parts else "only one cluster size was run.")


def _target(rows: Sequence[SizeRow], target: Target) -> str:
    parts = [
        f"{_workers(r.num_workers)} after {r.target_step} global steps, {r.target_s:.2f} s"
        if r.target_step is not None and r.target_s is not None
        else f"{_workers(r.num_workers)} never (final {target.metric} {r.final_metric})"
        for r in rows
    ]
    return f"Target {target}: reached with " + "; ".join(parts) + "."


def _time(row: SizeRow) -> str:
    assert row.breakdown is not None
    shares = row.breakdown.fractions
    # Pushes start from backward's hooks, so their time is in both compute and communication: the sum can pass 100%.
    named = {
        "compute": "computing (forward and backward, which start the pushes)",
        "communication": "communicating with the PS (pushing and waiting for replies)",
        "input_wait": "waiting for input",
    }
    spent = ", ".join(f"{shares[part]:.0%} {words}" for part, words in named.items())
    text = f"With {_workers(row.num_workers)} each worker step spends {spent}"
    if row.breakdown.busiest_ps:
        text += f"; {row.breakdown.busiest_ps} is busy {row.breakdown.ps_busy:.0%} of the time"
    return f"{text}. Diagnosis: {row.breakdown.diagnosis}."


def _workers(count: int) -> str:
    return f"{count} worker{'' if count == 1 else 's'}"


def plot(rows: Sequence[SizeRow], target: Target | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, by_step, by_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = [r.num_workers for r in rows]
    speed.plot(sizes, [r.global_steps_per_s for r in rows], "o-", label="measured")
    base = rows[0]
    ideal = [base.global_steps_per_s * n / base.num_workers for n in sizes]
    speed.plot(sizes, ideal, "--", color="grey", label="ideal (linear)")
    speed.set(xlabel="workers", ylabel="global steps / s", title="Throughput", xticks=sizes)
    speed.legend()
    metric = target.metric if target else "loss"
    for row in rows:
        history = [e for e in row.result.get("eval_history") or [] if metric in e["metrics"]]
        values = [e["metrics"][metric] for e in history]
        if history:
            by_step.plot([e["global_step"] for e in history], values, "o-", label=_workers(row.num_workers))
            by_time.plot([e["elapsed_s"] for e in history], values, "o-", label=_workers(row.num_workers))
    for axes, x_label in ((by_step, "global step"), (by_time, "seconds (chief's clock)")):
        if target is not None:
            axes.axhline(target.value, color="grey", linestyle="--", label=str(target))
        axes.set(xlabel=x_label, ylabel=metric, title=f"{metric} by {x_label.split()[0]}")
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_html(table: list[list[str]], paragraphs: Sequence[str], png: Path, path: Path, title: str) -> Path:
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in line) + "</tr>" for line in table[1:])
    text = "".join(f"<p>{html.escape(p)}</p>" for p in paragraphs)
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}</style>"
        f"</head><body><h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table>"
        f"<img alt='scaling plot' src='data:image/png;base64,{image}' style='max-width:100%'>{text}</body></html>"
    )
    return path
