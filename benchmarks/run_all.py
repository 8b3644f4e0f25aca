"""`make bench`: run the benchmarks, store each one's latest result, and write BENCHMARKS.md from all stored results.

Every benchmark runs shardflow beside its peers and prints one `RESULT {json}` line last (see result_line.py). This
script keeps that line, with the date, the command, the commit and the load on the machine while it ran, in
benchmarks/results/NAME.json, then rewrites BENCHMARKS.md from every stored result: running one benchmark updates
its rows and leaves the others as they were. A --quick run is a smoke run: its result is not stored.

Usage: python benchmarks/run_all.py [--quick] [--table-only] [NAME ...]   (no NAME: those of `make bench`)
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).parent
ROOT = HERE.parent
RESULTS = HERE / "results"
TABLE = ROOT / "BENCHMARKS.md"
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    name: str
    script: str
    flags: tuple[str, ...] = ()
    quick_flags: tuple[str, ...] = ("--quick",)
    in_make_bench: bool = True
    """False: a side-by-side study of one setting, run by name only."""
    about: str = ""
    """What it measures; the first line of the script's docstring if empty."""


QUICK_TRAINING = ("--steps", "1000", "--repeats", "1")
# Quickest first.
BENCHMARKS = [
    Benchmark(name="cli_startup", script="cli_startup.py"),
    Benchmark(name="comm_roundtrip", script="comm_roundtrip.py"),
    Benchmark(name="ps_training", script="ps_training.py", quick_flags=QUICK_TRAINING),
    Benchmark(name="allreduce_vs_ddp", script="allreduce_vs_ddp.py", quick_flags=("--steps", "500", "--repeats", "1")),
    Benchmark(name="profiler_overhead", script="profiler_overhead.py", quick_flags=QUICK_TRAINING),
    Benchmark(name="profiler", script="profiler.py"),
    Benchmark(name="input_formats", script="input_formats.py"),
    Benchmark(name="input_pipeline", script="input_pipeline.py"),
    Benchmark(
        name="plan_validation",
        script="plan_validation.py",
        flags=("--model", "both", "--strategies", "ps,allreduce,hybrid", "--repeats", "4"),
    ),
    Benchmark(
        name="embedding_tables",
        script="embedding_tables.py",
        quick_flags=("--steps", "300", "--tf-steps", "100", "--local-steps", "100", "--repeats", "1"),
    ),
    Benchmark(
        name="strategies",
        script="strategies.py",
        quick_flags=("--mlp-steps", "300", "--click-steps", "300", "--allreduce-click-steps", "6", "--repeats", "1"),
    ),
    Benchmark(name="ps_apply", script="ps_apply.py", quick_flags=("--repeats", "20")),
    Benchmark(
        name="gpu_training",
        script="gpu_training.py",
        quick_flags=(
            *("--steps", "100", "--local-steps", "50", "--mlp-steps", "300", "--mlp-local-steps", "100"),
            *("--rec-rows", "100000", "--setups", "async-1w1ps"),
        ),
    ),
    Benchmark(
        name="ps_sync",
        script="ps_training.py",
        flags=("--sync",),
        quick_flags=QUICK_TRAINING,
        in_make_bench=False,
        about="Sync 2 workers + 1 PS against DistributedDataParallel with gloo, alternating, best against best.",
    ),
    Benchmark(
        name="ps_authentication",
        script="ps_training.py",
        flags=("--auth",),
        quick_flags=QUICK_TRAINING,
        in_make_bench=False,
        about="The job's authentication (the default) against SHARDFLOW_INSECURE=1, alternating.",
    ),
    Benchmark(
        name="ps_local_sockets",
        script="ps_training.py",
        flags=("--local-sockets",),
        quick_flags=QUICK_TRAINING,
        in_make_bench=False,
        about="The PS over a UNIX socket (the default on a local cluster) against loopback TCP, alternating.",
    ),
    Benchmark(
        name="ps_shared_memory",
        script="ps_training.py",
        flags=("--shared-memory",),
        quick_flags=QUICK_TRAINING,
        in_make_bench=False,
        about="Gradients and parameters through shared-memory lanes (the default) against the socket, alternating.",
    ),
    Benchmark(
        name="ps_features",
        script="ps_training.py",
        flags=("--features",),
        quick_flags=QUICK_TRAINING,
        in_make_bench=False,
        about="clip_grad_norm and bf16 autocast against neither, alternating.",
    ),
    Benchmark(
        name="gpu_training_1w",
        script="gpu_training.py",
        flags=(
            "--setups",
            "async-1w1ps",
            "--steps",
            "500",
            "--local-steps",
            "200",
            "--mlp-steps",
            "6000",
            "--repeats",
            "2",
        ),
        quick_flags=(
            *("--steps", "100", "--local-steps", "50", "--mlp-steps", "300", "--mlp-local-steps", "100"),
            *("--rec-rows", "100000", "--repeats", "1"),
        ),
        in_make_bench=False,
        about="gpu_training's 1 worker + 1 PS only (rec and the PS-training MLP on the CPU, the issue's CPU "
        "targets; rec and dense on a GPU): fits a small machine.",
    ),
    Benchmark(
        name="ps_against_commit",
        script="ps_against_commit.py",
        flags=("6ae3acb",),
        quick_flags=("--steps", "1000", "--repeats", "2"),
        in_make_bench=False,
        about="This tree's async and sync PS training against the tree before issue 19's refactor (6ae3acb), "
        "alternating.",
    ),
    Benchmark(
        name="ps_against_before_auth",
        script="ps_against_commit.py",
        flags=("7ce6469", "--repeats", "6"),
        quick_flags=("--steps", "1000", "--repeats", "2"),
        in_make_bench=False,
        about="This tree's async and sync PS training against the tree before issue 24's authentication (CURVE on "
        "TCP, PLAIN only on private sockets; 7ce6469), alternating.",
    ),
]
BY_NAME = {benchmark.name: benchmark for benchmark in BENCHMARKS}


def command_of(benchmark: Benchmark) -> str:
    """The command that measures it and stores its result."""
    return f"python benchmarks/run_all.py {benchmark.name}"


def about(benchmark: Benchmark) -> str:
    if benchmark.about:
        return benchmark.about
    docstring = ast.get_docstring(ast.parse((HERE / benchmark.script).read_text())) or ""
    return docstring.splitlines()[0] if docstring else ""


class LoadWatch:
    """The machine's load while a benchmark runs: the 1-minute load average, sampled, and the cores that processes
    other than the benchmark kept busy (the machine's busy CPU time minus the benchmark's, over the wall time)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self._interval_s = interval_s
        self._samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._started = time.monotonic()
        self._machine_busy = _machine_busy_s()
        self._children = _children_cpu_s()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._samples.append(os.getloadavg()[0])
        wall = time.monotonic() - self._started
        others = (_machine_busy_s() - self._machine_busy) - (_children_cpu_s() - self._children)
        return {
            "load_average_median": round(statistics.median(self._samples), 2),
            "load_average_max": round(max(self._samples), 2),
            "other_processes_cores": round(max(0.0, others / wall), 2),
            "seconds": round(wall),
        }


def _machine_busy_s() -> float:
    """CPU seconds the machine has spent on any process (guest time is already inside user time)."""
    times = psutil.cpu_times()
    return float(sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq")))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _commit() -> str:
    """The commit measured, marked when the tree had changes beyond it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "benchmarks/*.py", "benchmarks/peers"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (" with uncommitted changes" if status.stdout.strip() else "")


def run(benchmark: Benchmark, *, quick: bool) -> dict[str, Any] | None:
    """Run one benchmark, its output passed through; its stored result, or None if it printed no RESULT line."""
    flags = [*benchmark.flags, *(benchmark.quick_flags if quick else ())]
    print(f"== {benchmark.name}: {benchmark.script} {' '.join(flags)}", flush=True)
    started = datetime.datetime.now(datetime.UTC)
    watch = LoadWatch()
    process = subprocess.Popen(
        [sys.executable, str(HERE / benchmark.script), *flags], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = None
    for output in process.stdout:
        print(output, end="", flush=True)
        if output.startswith(RESULT_PREFIX):
            line = output
    exit_status = process.wait()
    load = watch.stop()
    print(f"== {benchmark.name}: exit {exit_status} after {load['seconds']}s\n", flush=True)
    if line is None:
        return None
    printed = json.loads(line.removeprefix(RESULT_PREFIX))
    return {
        "benchmark": benchmark.name,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", f"benchmarks/{benchmark.script}", *flags]),
        "commit": _commit(),
        "exit_status": exit_status,
        "machine": {"cores": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30)},
        "load": load,
        "rows": printed["rows"],
        "figures": printed["figures"],
    }


def stored_results() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run; nothing is stored")
    parser.add_argument("--table-only", action="store_true", help="run nothing; rewrite BENCHMARKS.md")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"some of: {', '.join(BY_NAME)}")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    chosen = [BY_NAME[name] for name in args.names] or [b for b in BENCHMARKS if b.in_make_bench]
    failed = []
    for benchmark in [] if args.table_only else chosen:
        result = run(benchmark, quick=args.quick)
        if result is None or result["exit_status"]:
            failed.append(benchmark.name)
        if result is not None and not args.quick:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"{benchmark.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if not args.quick:
        TABLE.write_text(render(stored_results()))
        print(f"wrote {TABLE.relative_to(ROOT)}")
    if failed:
        print(f"failed or printed no RESULT line: {', '.join(failed)}")
    return 1 if failed else 0


def render(results: dict[str, dict[str, Any]]) -> str:
    """BENCHMARKS.md: one current table of every benchmark's rows, then how each was measured."""
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`benchmarks/run_all.py`) from the latest result of each benchmark, kept in",
        "`benchmarks/results/NAME.json`; `python benchmarks/run_all.py NAME` runs one and rewrites its rows. Do not",
        "edit it by hand. The measurements made before this table, and the reasoning that came with them, are in",
        "this file's git history.",
        "",
        "Each row compares shardflow with a peer run side by side in the same script on the same machine, alternating",
        "where the script can; the ratio is shardflow's figure over the peer's. The machine may be shared: the load",
        "column gives the 1-minute load average while the benchmark ran (median, and max) and the cores that other",
        "processes kept busy meanwhile. Ratios measured under load swing more than on a quiet machine.",
        "",
        "| benchmark | measure | shardflow | peer | peer's figure | ratio | target | met | date | load while it ran |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for benchmark in BENCHMARKS:
        lines += table_rows(benchmark, results.get(benchmark.name))
    lines += [
        "",
        "## How each was measured",
        "",
        "| benchmark | what it measures | command | commit | seconds | exit status |",
        "|---|---|---|---|---|---|",
    ]
    for benchmark in BENCHMARKS:
        result = results.get(benchmark.name)
        if result is None:
            lines.append(f"| {benchmark.name} | {about(benchmark)} | `{command_of(benchmark)}` | | | |")
            continue
        lines.append(
            f"| {benchmark.name} | {about(benchmark)} | `{result['command']}` | {result['commit']} "
            f"| {result['load']['seconds']} | {result['exit_status']} |"
        )
    not_in_make_bench = ", ".join(b.name for b in BENCHMARKS if not b.in_make_bench)
    lines += ["", f"`make bench` runs all but {not_in_make_bench}, which run by name.", ""]
    return "\n".join(lines)


def table_rows(benchmark: Benchmark, result: dict[str, Any] | None) -> list[str]:
    if result is None:
        note = f"not measured since the table was introduced: `{command_of(benchmark)}`"
        return [f"| {benchmark.name} | {note} | | | | | | | | |"]
    load = result["load"]
    machine = f"load average {load['load_average_median']:.1f} (max {load['load_average_max']:.1f}); "
    machine += f"other processes {load['other_processes_cores']:.2f} of {result['machine']['cores']} cores"
    met = {True: "yes", False: "**no**", None: ""}
    return [
        f"| {benchmark.name} | {row['measure']} | {_figure(row['shardflow'])} | {row['peer']} "
        f"| {_figure(row['peer_figure'])} | {_ratio(row['ratio'])} | {row['target']} | {met[row['met']]} "
        f"| {result['date']} | {machine} |"
        for row in result["rows"]
    ]


def _figure(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if magnitude >= 0.1 else f"{value:.3g}"


def _ratio(value: float) -> str:
    if value != value:  # NaN: the peer's figure was 0
        return "-"
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"1/{1 / value:,.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
