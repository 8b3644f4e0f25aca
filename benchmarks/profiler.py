"""Profiler costs: (a) the always-on recorder's step-time overhead, (b) analysis time of a large capture.

(a) runs a training-like loop (~1 ms of torch compute, 10 spans per step) with and without a recorder,
alternating repeats, and reports the ratio of best step times (target <= 1.02).
(b) writes a synthetic capture of NUM_EVENTS events, converts it to Parquet and runs the analyzers, next to
torch.profiler's key_averages() over the same number of steps of a real loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from result_line import print_result, row

from shardflow.profile.analysis import memory, top
from shardflow.profile.diagnose import steps
from shardflow.profile.events import build_table, load
from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.trace import write_trace


def make_model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return model, torch.randn(64, 256)


def train_step(model: torch.nn.Module, batch: torch.Tensor, step: int, recorder: SpanRecorder | None) -> None:
    """One worker step as the runtime records it: 8 spans and 2 flows (10 recorder calls)."""
    r = recorder
    step_start = time.perf_counter_ns()
    token = r.begin("input_wait", step) if r else 0
    inputs = batch  # the batch is ready: the input pipeline is not what is measured here
    if r:
        r.end("input_wait", step, token)
        token = r.begin("forward", step)
    loss = model(inputs).square().mean()
    if r:
        r.end("forward", step, token)
        token = r.begin("backward", step)
    loss.backward()
    if r:
        r.end("backward", step, token)
    for ps in range(2):
        token = r.begin("push", step) if r else 0
        if r:
            r.flow("push", step, step * 2 + ps, True)
            r.end("push", step, token, ps, 1 << 20)
    for ps in range(2):
        token = r.begin("pull_wait", step) if r else 0
        if r:
            r.end("pull_wait", step, token, ps)
    model.zero_grad(set_to_none=True)
    if r:
        r.end("step", step, step_start)


def recorder_overhead(num_steps: int, repeats: int) -> dict[str, Any]:
    """Steps with and without the recorder, alternating in blocks of 10 within one process, so that a change of load
    on a shared machine falls on both alike; the overhead is the ratio of the totals, and the spread is that of the
    ratios of neighbouring blocks."""
    torch.set_num_threads(1)
    model, batch = make_model()
    for step in range(50):
        train_step(model, batch, step, None)
    recorder = SpanRecorder("worker:0")  # one recorder throughout, as in a long run: its ring fills and wraps
    block = 10
    totals = {"without": 0.0, "with": 0.0}
    pair_ratios: list[float] = []
    step = 0
    for _ in range(max(1, num_steps * repeats // (2 * block))):
        seconds = {}
        for variant in ("without", "with") if step % (4 * block) == 0 else ("with", "without"):
            start = time.perf_counter()
            for _ in range(block):
                train_step(model, batch, step, recorder if variant == "with" else None)
                step += 1
            seconds[variant] = time.perf_counter() - start
            totals[variant] += seconds[variant]
        pair_ratios.append(seconds["with"] / seconds["without"])
    steps_each = step // 2
    quartiles = statistics.quantiles(pair_ratios, n=4)
    return {
        "steps_each": steps_each,
        "step_ms_without": round(totals["without"] / steps_each * 1e3, 4),
        "step_ms_with": round(totals["with"] / steps_each * 1e3, 4),
        "ratio": round(totals["with"] / totals["without"], 4),
        "pair_ratio_quartiles": [round(q, 4) for q in quartiles],
        "recorder_calls_per_step": 10,
        "ns_per_span": round(nanoseconds_per_span(num_steps * 100)),
    }


def nanoseconds_per_span(num_spans: int) -> float:
    """begin + end of one span, on an otherwise idle loop."""
    recorder = SpanRecorder("worker:0")
    start = time.perf_counter_ns()
    for step in range(num_spans):
        recorder.end("forward", step, recorder.begin("forward", step), 1, 2)
    return (time.perf_counter_ns() - start) / num_spans


def synthetic_capture(num_events: int, path: Path) -> int:
    """4 workers and 2 PS; each worker step has 6 spans and 40 ops. Returns the number of global steps."""
    events: list[dict[str, Any]] = []
    roles = ["worker:0", "worker:1", "worker:2", "worker:3", "ps:0", "ps:1"]
    for pid, role in enumerate(roles, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "MainThread"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "MainThread ops"}})
    step = 0
    while len(events) < num_events:
        for worker in range(4):
            pid, t = worker + 1, step * 1000.0
            spans = [("step", 0, 1000), ("input_wait", 0, 100), ("forward", 100, 300), ("backward", 400, 400)]
            spans += [("push", 800, 50), ("pull_wait", 850, 140)]
            for name, offset, duration in spans:
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": "span",
                        "pid": pid,
                        "tid": 1,
                        "ts": t + offset,
                        "dur": duration,
                        "args": {"step": step, "ps": 0, "bytes": 1 << 20},
                    }
                )
            for op in range(40):
                events.append(
                    {
                        "ph": "X",
                        "name": f"aten::op{op % 12}",
                        "cat": "op",
                        "pid": pid,
                        "tid": 2,
                        "ts": t + 100 + op * 17,
                        "dur": 15,
                        "args": {"step": step, "shape": "[[64,256]]", "source": f"model.py({op % 7}): forward"},
                    }
                )
            events.append({"ph": "C", "name": "memory.rss", "pid": pid, "ts": t, "args": {"value": 1e8 + step}})
            for ps in range(2):
                events.append(
                    {
                        "ph": "X",
                        "name": "apply",
                        "cat": "span",
                        "pid": 5 + ps,
                        "tid": 1,
                        "ts": t + 860 + worker * 20,
                        "dur": 15,
                        "args": {"step": step, "worker": worker, "bytes": 1 << 20},
                    }
                )
            step += 1
    write_trace({"traceEvents": events, "otherData": {"base_time_ns": 0, "roles": {}}}, path)
    return step


def analysis_time(num_events: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "merged.trace.json.gz"
        num_steps = synthetic_capture(num_events, trace)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        table = load(build_table(trace, Path(directory) / "events.parquet"))
        timings["to_parquet_s"] = time.perf_counter() - start
        for name, analyze in {"top": top, "steps": steps, "memory": memory}.items():
            start = time.perf_counter()
            analyze(table)
            timings[f"{name}_s"] = time.perf_counter() - start
        timings["rows"] = table.num_rows
    timings.update(torch_key_averages(num_steps // 4))  # a worker's steps: the profiler sees one process
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in timings.items()}


def torch_key_averages(num_steps: int) -> dict[str, Any]:
    model, batch = make_model()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        for step in range(num_steps):
            train_step(model, batch, step, None)
    start = time.perf_counter()
    profiler.key_averages(group_by_input_shape=True)
    return {
        "torch_steps": num_steps,
        "torch_events": len(profiler.events()),
        "torch_key_averages_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--only", choices=["overhead", "analysis"], help="run one of the two parts")
    args = parser.parse_args(argv)
    steps_per_repeat, repeats, num_events = (300, 3, 100_000) if args.quick else (2000, 7, 1_000_000)
    result = {}
    if args.only in (None, "overhead"):
        result["recorder_overhead"] = recorder_overhead(steps_per_repeat, repeats)
    if args.only in (None, "analysis"):
        result["analysis"] = analysis_time(num_events)
    json.dump(result, sys.stdout, indent=2)
    print()
    print_result("profiler", result, result_rows(result))
    return 0


def result_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """BENCHMARKS.md's rows: the recorder's cost in a step, and analysis speed against torch.profiler's."""
    rows = []
    if overhead := result.get("recorder_overhead"):
        with_, without = overhead["step_ms_with"], overhead["step_ms_without"]
        measure = "training-like step, ms (recorder in-process, alternating blocks of 10)"
        rows.append(row(measure, with_, "no recorder", without, ratio=overhead["ratio"], target="<= 1.02"))
    if analysis := result.get("analysis"):
        seconds = sum(analysis[f"{name}_s"] for name in ("to_parquet", "top", "steps", "memory"))
        measure = "capture analysis, events/s (Parquet + top + steps + memory)"
        peer = "torch.profiler key_averages()"
        rows.append(
            row(measure, analysis["rows"] / seconds, peer, analysis["torch_events"] / analysis["torch_key_averages_s"])
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
