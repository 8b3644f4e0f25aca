"""PS (async, sync), all-reduce and hybrid on the benchmark MLP and the click-through model: examples/s, the winner.

PS: 2 workers + 1 PS; all-reduce: 2 workers; hybrid (HybridStrategy: the sf.nn tables on 1 PS, async, the head
all-reduced by the 2 workers) on the click-through model; side by side in one run. The benchmark MLP has no sf.nn
table, so its hybrid job would be the all-reduce one (HybridStrategy refuses a model without tables).

Each rate is the steady state, from the workers' step logs after a warm-up. Examples per global step come from the
job's own count (a global step is one worker's batch in async mode, one batch on every worker in sync and all-reduce).
AllReduceStrategy refuses sf.nn tables and sparse embeddings, so its click-through run holds the same tables as dense
torch.nn.Embedding/EmbeddingBag on every worker. That run is one, not alternated: a step all-reduces the 10M-row
table's whole gradient (640 MB), and a job ends with a checkpoint that, in this tree, does not fit the control store
(params and Adagrad slots, 1.3 GB, over its 1 GiB): its steps are timed from the step logs and the failure is kept.

Usage: python benchmarks/strategies.py [--mlp-steps N] [--click-steps N] [--allreduce-click-steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click_model as cm
from embedding_tables import TMPDIR
from mlp import BATCH
from ps_training import shardflow_job
from result_line import print_result, row
from step_log import read_step_logs, steady_steps_per_s

HERE = Path(__file__).parent
WORKERS = 2
MLP_WARMUP_STEPS = 50
SETUPS = {"PS async 2w+1PS": ("async", 1), "PS sync 2w+1PS": ("sync", 1), "all-reduce 2w": ("allreduce", 0)}
"""Each setup's mode and PS count."""
HYBRID = "hybrid 2w+1PS"
CLICK_SETUPS = {**SETUPS, HYBRID: ("hybrid", 1)}
"""The click-through model's setups: those of the MLP, and hybrid."""


def mlp_examples_per_s(mode: str, num_ps: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        prefix = f"{directory}/steps"
        result = shardflow_job(WORKERS, num_ps, steps, mode=mode, env={"SHARDFLOW_BENCH_STEP_LOG": prefix})
        rate = steady_steps_per_s(read_step_logs(prefix), MLP_WARMUP_STEPS)
    return rate * BATCH * sum(result["worker_steps"].values()) / result["global_step"]


def click_examples_per_s(mode: str, num_ps: int, steps: int) -> tuple[float, str]:
    """Examples/s, and the failing role's error line of a job that failed after training every step ("" if none)."""
    with tempfile.TemporaryDirectory() as directory:
        out = f"{directory}/result.json"
        command = [sys.executable, str(HERE / "jobs" / "click_through.py"), out, str(WORKERS), str(num_ps), str(steps)]
        finished = subprocess.run(
            [*command, mode],
            env={**os.environ, **TMPDIR},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        if finished.returncode == 0:
            result = json.loads(Path(out).read_text())
            per_step = cm.BATCH * sum(result["worker_steps"].values()) / result["global_step"]
            return result["steps_per_s"] * per_step, ""
        logs = read_step_logs(f"{out}.steps")
    # The role's own error, not the launcher's RoleFailedError that only says it exited.
    errors = [line for line in finished.stdout.splitlines() if "Error: " in line and "RoleFailedError" not in line]
    reason = errors[0] if errors else "\n".join(finished.stdout.strip().splitlines()[-1:])
    if len(logs) != WORKERS or any(log[-1][1] < steps for log in logs):
        raise RuntimeError(f"the click-through {mode} job failed before its last step: {reason}")
    # It trained every step: one batch on every worker per global step (sync or all-reduce); warm-up as the job's.
    return steady_steps_per_s(logs, min(30, steps // 3)) * cm.BATCH * WORKERS, reason


def model_rows(model: str, best: dict[str, float], allreduce_note: str) -> list[dict[str, Any]]:
    """all-reduce (and hybrid, where measured) against each PS mode, each row naming the winner."""
    winner = max(best, key=lambda name: best[name])
    rows = []
    for name in SETUPS:
        if name == "all-reduce 2w":
            continue
        measure = f"{model}, examples/s: all-reduce 2 workers{allreduce_note} (winner: {winner})"
        rows.append(row(measure, best["all-reduce 2w"], f"shardflow {name}", best[name]))
        if HYBRID in best:
            measure = f"{model}, examples/s: {HYBRID} (winner: {winner})"
            rows.append(row(measure, best[HYBRID], f"shardflow {name}", best[name]))
    return rows


def failure_note(failure: str) -> str:
    if not failure:
        return ""
    if "control store is full" in failure:
        return (
            "; the job trained every step, then failed: its final checkpoint (params and Adagrad slots, 1.3 GB) "
            "does not fit the control store (1 GiB)"
        )
    return f"; the job trained every step, then failed: {failure[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlp-steps", type=int, default=1000)
    parser.add_argument("--click-steps", type=int, default=1000)
    parser.add_argument("--allreduce-click-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    mlp: dict[str, list[float]] = {name: [] for name in SETUPS}
    click: dict[str, list[float]] = {name: [] for name in CLICK_SETUPS}
    for repeat in range(args.repeats):
        order = list(SETUPS) if repeat % 2 == 0 else list(reversed(SETUPS))
        for name in order:
            mlp[name].append(mlp_examples_per_s(*SETUPS[name], args.mlp_steps))
        for name in [*order, HYBRID] if repeat % 2 else [HYBRID, *order]:
            if name != "all-reduce 2w":
                click[name].append(click_examples_per_s(*CLICK_SETUPS[name], args.click_steps)[0])
    allreduce_click, failure = click_examples_per_s("allreduce", 0, args.allreduce_click_steps)
    click["all-reduce 2w"].append(allreduce_click)
    for model, runs in (("benchmark MLP", mlp), ("click-through", click)):
        rates = "; ".join(f"{name} {', '.join(f'{v:,.0f}' for v in values)}" for name, values in runs.items())
        print(f"{model}, examples/s: {rates}")
    if failure:
        print(f"the all-reduce click-through job failed after its last step: {failure}")
    best_mlp = {name: max(values) for name, values in mlp.items()}
    best_click = {name: max(values) for name, values in click.items()}
    figures = {
        "mlp_examples_per_s": mlp,
        "click_examples_per_s": click,
        "mlp_winner": max(best_mlp, key=lambda name: best_mlp[name]),
        "click_winner": max(best_click, key=lambda name: best_click[name]),
        "click_allreduce_tables": "dense torch.nn.Embedding/EmbeddingBag (sparse=False)",
        "click_allreduce_failure": failure,
        "mlp_hybrid": "the MLP has no sf.nn tables: its hybrid job is the all-reduce one",
    }
    click_note = " (dense torch.nn tables)" + failure_note(failure)
    rows = model_rows("benchmark MLP", best_mlp, "") + model_rows("click-through", best_click, click_note)
    print_result("strategies", figures, rows)


if __name__ == "__main__":
    main()
