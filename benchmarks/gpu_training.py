"""GPU workers against the one-process PyTorch loop on the same device, side by side in one run (issue 21).

The models of gpu_models.py (rec: 4 tables 1M x 32 + MLP 128-512-256-1, batch 2048, Adagrad; dense: MLP
1024-2048-2048-10, batch 512, SGD; mlp: the PS-training MLP 64-512-512-10, batch 32, SGD), each trained by the
one-process loop and by shardflow in each setup (async 1w+1PS, 2w+2PS, 4w+4PS; sync 2w+2PS) with its workers on
`--device` (CUDA where there is a GPU), steps/s each and the ratio to the one-process loop. By default rec and dense
on CUDA, rec and mlp on the CPU (dense takes about a second a step on a small CPU). Targets: on CUDA, rec 1w+1PS
>= 0.5x and 4w+4PS >= 0.8x, dense 1w+1PS >= 0.3x and 4w+4PS >= 0.6x; on the CPU, rec 1w+1PS >= 0.7x and mlp
1w+1PS >= 0.8x.

Usage: python benchmarks/gpu_training.py [--device cpu|cuda] [--models rec,dense,mlp] [--setups async-1w1ps,...]
       [--steps N] [--local-steps N] [--mlp-steps N] [--mlp-local-steps N] [--repeats R] [--rec-rows N]
       [--rec-tables sfnn|sparse]

The mlp model's steps take about 1 ms, so its jobs run --mlp-steps and its one-process loop --mlp-local-steps: a
CPU worker of a local cluster times its steps on one and two threads for about a second after its first 10
(train/thread_tuning.py), and a 1,000-step job would measure little else.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import Any

import gpu_models as gm
import torch
from ps_training import run_json
from result_line import print_result, row

HERE = Path(__file__).parent
SETUPS = ("async-1w1ps", "async-2w2ps", "async-4w4ps", "sync-2w2ps")
TARGETS = {
    ("cuda", "rec", "async-1w1ps"): ">= 0.5",
    ("cuda", "rec", "async-4w4ps"): ">= 0.8",
    ("cuda", "dense", "async-1w1ps"): ">= 0.3",
    ("cuda", "dense", "async-4w4ps"): ">= 0.6",
    ("cpu", "rec", "async-1w1ps"): ">= 0.7",
    ("cpu", "mlp", "async-1w1ps"): ">= 0.8",
}
DEFAULT_THREADS = torch.get_num_threads()


def parse_setup(setup: str) -> tuple[str, int, int]:
    """'async-2w2ps' -> ('async', 2, 2); a ValueError names the setup and the accepted form."""
    found = re.fullmatch(r"(async|sync)-(\d+)w(\d+)ps", setup)
    if not found:
        raise ValueError(f"setup {setup!r}: expected MODE-NwMps, e.g. async-2w2ps or sync-2w2ps")
    return found[1], int(found[2]), int(found[3])


class LocalLoop:
    """The one-process PyTorch loop of one model on `device`: the same model, batches and optimizer, each batch
    moved to the device as shardflow's workers move theirs."""

    def __init__(self, model_name: str, device: torch.device, rec_rows: int) -> None:
        self.model_name, self.device = model_name, device
        if model_name == "rec":
            self.model: torch.nn.Module = gm.local_rec_model(rec_rows).to(device)
            adagrad = {"lr": gm.LR["rec"], "initial_accumulator_value": gm.INITIAL_ACCUMULATOR}
            tables = [p for name, p in self.model.named_parameters() if name.startswith("tables.")]
            head = [p for name, p in self.model.named_parameters() if not name.startswith("tables.")]
            self.optimizers = [torch.optim.Adagrad(tables, **adagrad), torch.optim.Adagrad(head, **adagrad)]
        else:
            self.model = gm.dense_model(model_name).to(device)
            self.optimizers = [torch.optim.SGD(self.model.parameters(), lr=gm.LR[model_name])]
        self.batches = gm.batches(model_name, 0, rec_rows)

    def step(self, i: int) -> None:
        x, y = self.batches[i % len(self.batches)]
        batch = (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        gm.loss(self.model_name, self.model, batch).backward()
        for optimizer in self.optimizers:
            optimizer.step()

    def steps_per_s(self, steps: int) -> float:
        """On the CPU at its best: torch's default threads or one, whichever is faster over 20 steps (on a loaded
        machine, threads that wait for each other at every op can cost 10x)."""
        if self.device.type == "cpu":
            rates = {}
            for threads in (DEFAULT_THREADS, 1):
                torch.set_num_threads(threads)
                rates[threads] = self._timed(20)
            torch.set_num_threads(max(rates, key=rates.__getitem__))
        return self._timed(steps)

    def _timed(self, steps: int) -> float:
        for i in range(5):
            self.step(i)
        self._synchronize()
        started = time.perf_counter()
        for i in range(steps):
            self.step(i)
        self._synchronize()
        return steps / (time.perf_counter() - started)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def shardflow_job(model_name: str, setup: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, workers, ps = parse_setup(setup)
    steps, _ = run_steps(model_name, args)
    command = [str(HERE / "jobs" / "gpu_model.py"), model_name, str(workers), str(ps), str(steps), mode]
    result = run_json([*command, args.device, str(args.rec_rows), args.rec_tables])
    if result["global_step"] != steps:
        raise RuntimeError(f"shardflow's {model_name} {setup} job ended at global step {result['global_step']}")
    return result


def run_steps(model_name: str, args: argparse.Namespace) -> tuple[int, int]:
    """Global steps of the model's shardflow jobs and timed steps of its one-process loop."""
    if model_name == "mlp":
        return args.mlp_steps, args.mlp_local_steps
    return args.steps, args.local_steps


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per model, steps/s of the local loop and of each setup, once per repeat, in turn."""
    runs: dict[str, dict[str, list[float]]] = {}
    for model_name in args.models:
        local = LocalLoop(model_name, torch.device(args.device), args.rec_rows)
        runs[model_name] = {name: [] for name in ("local", *args.setups)}
        for _ in range(args.repeats):
            runs[model_name]["local"].append(local.steps_per_s(run_steps(model_name, args)[1]))
            for setup in args.setups:
                runs[model_name][setup].append(shardflow_job(model_name, setup, args)["steps_per_s"])
            latest = ", ".join(f"{name} {rates[-1]:,.1f}" for name, rates in runs[model_name].items())
            print(f"{model_name}, steps/s: {latest}", flush=True)
        del local
    return runs


def result_rows(runs: dict[str, dict[str, list[float]]], args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """BENCHMARKS.md's rows: each setup's best steps/s against the local loop's best, the device named."""
    rows = []
    for model_name, rates in runs.items():
        local = max(rates["local"])
        size = _describe(model_name, args)
        for setup in args.setups:
            mode, workers, ps = parse_setup(setup)
            unit = "global steps/s" if mode == "sync" else "steps/s"
            measure = f"{size} on {device}: {mode} {_count(workers, 'worker')} + {ps} PS, {unit}"
            target = TARGETS.get((args.device, model_name, setup), "")
            peer = "one-process PyTorch loop, same device"
            rows.append(row(measure, max(rates[setup]), peer, local, target=target))
    return rows


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}{'' if num == 1 else 's'}"


def _describe(model_name: str, args: argparse.Namespace) -> str:
    if model_name == "rec":
        tables = "sf.nn" if args.rec_tables == "sfnn" else "sparse nn.Embedding"
        return f"rec ({gm.NUM_TABLES} {tables} tables {args.rec_rows:,} x {gm.TABLE_DIM}, batch {gm.BATCH['rec']})"
    if model_name == "dense":
        return f"dense (MLP 1024-2048-2048-10, batch {gm.BATCH['dense']})"
    return f"MLP 64-512-512-10, batch {gm.BATCH['mlp']}"


def device_name(device: str) -> str:
    """The card or processor the figures were measured on, for the result."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (GPU)"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return f"{line.partition(':')[2].strip()} (CPU, {os.cpu_count()} cores)"
    return f"a CPU ({os.cpu_count()} cores)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--models", help=f"comma-separated, of: {', '.join(gm.MODELS)}; default rec,dense on CUDA, rec,mlp on the CPU"
    )
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, MODE-NwMps: " + ", ".join(SETUPS))
    parser.add_argument("--steps", type=int, default=1000, help="global steps of each shardflow job")
    parser.add_argument("--mlp-steps", type=int, default=8000, help="global steps of each job of the mlp model")
    parser.add_argument("--local-steps", type=int, default=500, help="timed steps of the one-process loop")
    parser.add_argument("--mlp-local-steps", type=int, default=3000, help="timed steps of the mlp model's loop")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rec-rows", type=int, default=gm.REC_ROWS, help="rows of each of the rec model's tables")
    parser.add_argument("--rec-tables", choices=("sfnn", "sparse"), default="sfnn")
    args = parser.parse_args()
    args.models = (args.models or ("rec,dense" if args.device == "cuda" else "rec,mlp")).split(",")
    args.setups = args.setups.split(",")
    unknown = sorted(set(args.models) - set(gm.MODELS))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(gm.MODELS)}")
    for setup in args.setups:
        try:
            parse_setup(setup)
        except ValueError as error:
            parser.error(f"--setups: {error}")
    return args


def main() -> None:
    args = parse_args()
    if "rec" in args.models and args.rec_rows != gm.REC_ROWS:
        print(f"rec: tables of {args.rec_rows:,} rows, not the issue's {gm.REC_ROWS:,} (--rec-rows)", flush=True)
    runs = measure(args)
    figures: dict[str, Any] = {
        "device": device_name(args.device),
        "steps": args.steps,
        "mlp_steps": args.mlp_steps,
        "rec_rows": args.rec_rows,
        "rec_tables": args.rec_tables,
        "runs": runs,
    }
    print(f"device: {figures['device']}")
    print(f"{'model':8} {'run':14} {'steps/s (each repeat)':>26} {'ratio':>7}")
    for model_name, rates in runs.items():
        local = max(rates["local"])
        for name, values in rates.items():
            ratio = max(values) / local
            print(f"{model_name:8} {name:14} {', '.join(f'{v:,.1f}' for v in values):>26} {ratio:7.3f}")
    print_result("gpu_training", figures, result_rows(runs, args, figures["device"]))


if __name__ == "__main__":
    main()
