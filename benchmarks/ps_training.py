"""Parameter-server training throughput, side by side with its peers in one run.

- async, 1 PS + 2 workers, MLP 64-512-512-10, batch 32: shardflow vs TensorFlow ParameterServerStrategy
  (target >= 3x steps/s; also reports TF's own iteration count against the steps it ran);
- 1 worker + 1 PS vs a single-process PyTorch loop (target >= 0.7x);
- with --sync: sync, 2 workers + 1 PS vs PyTorch DistributedDataParallel with gloo, 2 processes (target >= 1.0x).

Usage: python benchmarks/ps_training.py [--steps N] [--repeats R]
       [--no-tf | --features | --auth | --local-sockets | --shared-memory | --sync]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from mlp import BATCH, NUM_EXAMPLES, mlp, synthetic_data
from result_line import print_result, row

HERE = Path(__file__).parent


def run_json(command: list[str], env: dict[str, str] | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, *command[:1], out.name, *command[1:]],
            env={**os.environ, **(env or {})},
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(out.name).read_text())


def local_loop(steps: int) -> float:
    """The single-process PyTorch loop: same model, batch and optimizer, no parameter server."""
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_data()

    def step(i: int) -> None:
        j = (i * BATCH) % NUM_EXAMPLES
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[j : j + BATCH]), y[j : j + BATCH]).backward()
        optimizer.step()

    for i in range(50):
        step(i)
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    return steps / (time.perf_counter() - started)


def shardflow_job(
    workers: int,
    ps: int,
    steps: int,
    mode: str = "async",
    overlap: bool = True,
    save_every: int = 0,
    features: str = "",
    env: dict[str, str] | None = None,
) -> dict:
    return run_json(
        [
            str(HERE / "jobs" / "mlp_async.py"),
            str(workers),
            str(ps),
            str(steps),
            mode,
            "1" if overlap else "0",
            str(save_every),
            features,
        ],
        env,
    )


def features_side_by_side(steps: int, repeats: int) -> None:
    """2 workers + 1 PS with gradient clipping by global norm and bf16 autocast against without, alternating."""
    plain, featured = [], []
    for _ in range(repeats):
        plain.append(shardflow_job(2, 1, steps)["steps_per_s"])
        featured.append(shardflow_job(2, 1, steps, features="clip,bf16")["steps_per_s"])
    print(f"2w+1PS plain, steps/s: {', '.join(f'{v:.0f}' for v in plain)}")
    print(f"2w+1PS clip_grad_norm + bf16, steps/s: {', '.join(f'{v:.0f}' for v in featured)}")
    ratio = statistics.median(featured) / statistics.median(plain)
    print(f"clip + bf16 vs plain (medians): {ratio:.2f}x")
    figures = {"plain_steps_per_s": plain, "clip_bf16_steps_per_s": featured, "ratio": ratio}
    measure = "2w+1PS global steps/s, clip_grad_norm + bf16 (medians)"
    rows = [row(measure, statistics.median(featured), "the same job without", statistics.median(plain))]
    print_result("ps_features", figures, rows)


def auth_side_by_side(steps: int, repeats: int) -> None:
    """2 workers + 1 PS on loopback with the job's authentication (the default) against SHARDFLOW_INSECURE=1."""
    on, off = [], []
    for _ in range(repeats):
        off.append(shardflow_job(2, 1, steps, env={"SHARDFLOW_INSECURE": "1"})["steps_per_s"])
        on.append(shardflow_job(2, 1, steps)["steps_per_s"])
    print(f"2w+1PS authentication off, steps/s: {', '.join(f'{v:.0f}' for v in off)}")
    print(f"2w+1PS authentication on (default), steps/s: {', '.join(f'{v:.0f}' for v in on)}")
    ratio = statistics.median(on) / statistics.median(off)
    print(f"on vs off (medians): {ratio:.2f}x")
    figures = {"auth_on_steps_per_s": on, "auth_off_steps_per_s": off, "ratio": ratio}
    measure = "2w+1PS global steps/s, authentication on (medians)"
    print_result(
        "ps_authentication",
        figures,
        [row(measure, statistics.median(on), "SHARDFLOW_INSECURE=1", statistics.median(off))],
    )


def on_off_side_by_side(steps: int, repeats: int, variable: str, labels: dict[str, str]) -> None:
    """2 workers + 1 PS with the environment variable `variable` on (the default) against off, alternating; CPU
    seconds of the whole job per 1,000 global steps beside. `labels` names each setting and gives each its key."""
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for _ in range(repeats):
        for setting in ("off", "on"):
            before = os.times()
            result = shardflow_job(2, 1, steps, env={variable: setting})
            after = os.times()
            cpu_s = (after.children_user - before.children_user) + (after.children_system - before.children_system)
            runs[setting].append((result["steps_per_s"], 1000 * cpu_s / result["global_step"]))
    for setting in ("off", "on"):
        rates = ", ".join(f"{rate:.0f}" for rate, _ in runs[setting])
        cpu = ", ".join(f"{c:.2f}" for _, c in runs[setting])
        print(f"2w+1PS {labels[setting]}: steps/s {rates}; CPU s per 1000 steps {cpu}")
    ratio = statistics.median(r for r, _ in runs["on"]) / statistics.median(r for r, _ in runs["off"])
    print(f"{labels['on']} vs {labels['off']} (medians): {ratio:.2f}x")
    result: dict[str, object] = {"ratio": ratio}
    for setting in ("off", "on"):
        key = labels[f"{setting}_key"]
        result[f"{key}_steps_per_s"] = [r for r, _ in runs[setting]]
        result[f"{key}_cpu_s_per_1000_steps"] = [c for _, c in runs[setting]]
    measure = f"2w+1PS global steps/s, {labels['on']} (medians)"
    on, off = (statistics.median(r for r, _ in runs[setting]) for setting in ("on", "off"))
    print_result(labels["benchmark"], result, [row(measure, on, labels["off"], off)])


LOCAL_SOCKETS = {
    "off": "loopback TCP",
    "on": "UNIX socket (default)",
    "off_key": "tcp",
    "on_key": "unix",
    "benchmark": "ps_local_sockets",
}
"""The PS over a UNIX socket (SHARDFLOW_LOCAL_SOCKETS=on, the default) against loopback TCP (with
SHARDFLOW_SHARED_MEMORY=on, the worker then uses no lanes: they need the UNIX socket)."""
SHARED_MEMORY = {
    "off": "UNIX socket only",
    "on": "shared-memory lanes (default)",
    "off_key": "socket",
    "on_key": "lanes",
    "benchmark": "ps_shared_memory",
}
"""Gradients and parameters through shared-memory lanes (SHARDFLOW_SHARED_MEMORY=on, the default) against through
the UNIX socket."""


def sync_side_by_side(steps: int, repeats: int) -> None:
    """shardflow sync, 2 workers + 1 PS, against DDP with gloo, 2 processes, alternating: one global step is one
    batch of 32 on each worker (process) in both."""
    shardflow, ddp = [], []
    for _ in range(repeats):
        result = shardflow_job(2, 1, steps, mode="sync")
        if result["global_step"] != steps:
            raise RuntimeError(f"shardflow's sync job ended at global step {result['global_step']}, not {steps}")
        shardflow.append(result["steps_per_s"])
        ddp.append(run_json([str(HERE / "peers" / "ddp_sync.py"), "2", str(steps)])["steps_per_s"])
    print(f"shardflow sync 2 workers + 1 PS, global steps/s: {', '.join(f'{v:.0f}' for v in shardflow)}")
    print(f"DDP gloo 2 processes, steps/s: {', '.join(f'{v:.0f}' for v in ddp)}")
    ratio = max(shardflow) / max(ddp)
    print(f"sync 2 workers vs DDP (best against best): {ratio:.2f}x (target >= 1.0x)")
    result = {"sf_sync_2w1ps_steps_per_s": shardflow, "ddp_gloo_2_steps_per_s": ddp, "ratio": ratio}
    measure = "sync 2 workers + 1 PS, global steps/s (best against best)"
    print_result(
        "ps_sync", result, [row(measure, max(shardflow), "PyTorch DDP (gloo), 2 processes", max(ddp), target=">= 1")]
    )


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["steps_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-tf", action="store_true", help="skip the TensorFlow peer")
    parser.add_argument(
        "--features", action="store_true", help="only: clip_grad_norm + bf16 against plain, alternating"
    )
    parser.add_argument("--auth", action="store_true", help="only: authentication on against off, alternating")
    parser.add_argument(
        "--local-sockets", action="store_true", help="only: the PS over a UNIX socket against loopback TCP, alternating"
    )
    parser.add_argument(
        "--shared-memory",
        action="store_true",
        help="only: gradients and parameters through shared-memory lanes against through the socket, alternating",
    )
    parser.add_argument(
        "--sync", action="store_true", help="only: sync 2 workers + 1 PS against DDP with gloo, alternating"
    )
    args = parser.parse_args()
    r = args.repeats
    if args.features:
        features_side_by_side(args.steps, r)
        return
    if args.auth:
        auth_side_by_side(args.steps, r)
        return
    if args.local_sockets:
        on_off_side_by_side(args.steps, r, "SHARDFLOW_LOCAL_SOCKETS", LOCAL_SOCKETS)
        return
    if args.shared_memory:
        on_off_side_by_side(args.steps, r, "SHARDFLOW_SHARED_MEMORY", SHARED_MEMORY)
        return
    if args.sync:
        sync_side_by_side(args.steps, r)
        return

    # The local loop at its best: torch's default threads (one per core) and one thread, whichever is faster.
    local = 0.0
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        local = max(local, *(local_loop(args.steps) for _ in range(r)))
    sf_1w = best([shardflow_job(1, 1, args.steps) for _ in range(r)])
    sf_1w_no_overlap = best([shardflow_job(1, 1, args.steps, overlap=False) for _ in range(r)])
    sf_2w = best([shardflow_job(2, 1, args.steps) for _ in range(r)])
    # The same run with a checkpoint at every 100th global step: what frequent checkpoints cost.
    sf_2w_ckpt = best([shardflow_job(2, 1, args.steps, save_every=100) for _ in range(r)])
    rows = [
        ("single-process PyTorch loop", local, ""),
        (
            "shardflow async 1 worker + 1 PS",
            sf_1w["steps_per_s"],
            f"global_step={sf_1w['global_step']}",
        ),
        ("shardflow async 1w+1PS, no overlap", sf_1w_no_overlap["steps_per_s"], ""),
        (
            "shardflow async 2 workers + 1 PS",
            sf_2w["steps_per_s"],
            f"global_step={sf_2w['global_step']}",
        ),
        (
            "shardflow async 2w+1PS, checkpoint every 100",
            sf_2w_ckpt["steps_per_s"],
            f"global_step={sf_2w_ckpt['global_step']}",
        ),
    ]
    result = {
        "local_steps_per_s": local,
        "sf_1w1ps_steps_per_s": sf_1w["steps_per_s"],
        "sf_1w1ps_no_overlap_steps_per_s": sf_1w_no_overlap["steps_per_s"],
        "sf_2w1ps_steps_per_s": sf_2w["steps_per_s"],
        "sf_2w1ps_global_step": sf_2w["global_step"],
        "ratio_1w1ps_vs_local": sf_1w["steps_per_s"] / local,
        "sf_2w1ps_checkpoint_every_100_steps_per_s": sf_2w_ckpt["steps_per_s"],
        "ratio_checkpoint_every_100": sf_2w_ckpt["steps_per_s"] / sf_2w["steps_per_s"],
    }
    if not args.no_tf:
        tf_steps = min(args.steps, 1000)
        tf = best([run_json([str(HERE / "peers" / "tf_ps.py"), "2", str(tf_steps)]) for _ in range(r)])
        rows.append(
            (
                "TF ParameterServerStrategy 2 workers + 1 PS",
                tf["steps_per_s"],
                f"iterations={tf['iterations']} of {tf['scheduled']} scheduled",
            )
        )
        result.update(
            tf_2w1ps_steps_per_s=tf["steps_per_s"],
            tf_iterations=tf["iterations"],
            tf_scheduled=tf["scheduled"],
            ratio_2w1ps_vs_tf=sf_2w["steps_per_s"] / tf["steps_per_s"],
        )

    sync = best([shardflow_job(2, 1, args.steps, mode="sync") for _ in range(r)])
    ddp = max(run_json([str(HERE / "peers" / "ddp_sync.py"), "2", str(args.steps)])["steps_per_s"] for _ in range(r))
    rows += [
        ("shardflow sync 2 workers + 1 PS", sync["steps_per_s"], f"global_step={sync['global_step']}"),
        ("PyTorch DDP (gloo) 2 processes", ddp, ""),
    ]
    result.update(
        sf_sync_2w1ps_steps_per_s=sync["steps_per_s"],
        ddp_gloo_2_steps_per_s=ddp,
        ratio_sync_2w_vs_ddp=sync["steps_per_s"] / ddp,
    )

    print(f"{'run':48} {'steps/s':>9}  notes")
    for name, rate, note in rows:
        print(f"{name:48} {rate:9.0f}  {note}")
    print(f"1 worker + 1 PS vs local loop: {result['ratio_1w1ps_vs_local']:.2f}x (target >= 0.7x)")
    print(f"checkpoint every 100 steps: {result['ratio_checkpoint_every_100']:.2f}x the steps/s without")
    print(f"sync 2 workers + 1 PS vs DDP: {result['ratio_sync_2w_vs_ddp']:.2f}x (target >= 1.0x)")
    if "ratio_2w1ps_vs_tf" in result:
        print(f"async 2 workers + 1 PS vs TF: {result['ratio_2w1ps_vs_tf']:.2f}x (target >= 3x)")
    print_result("ps_training", result, result_rows(result))


def result_rows(result: dict) -> list[dict]:
    """BENCHMARKS.md's rows: async against TF and the local loop, sync against DDP, frequent checkpoints."""
    rows = []
    if "tf_2w1ps_steps_per_s" in result:
        measure = "async 2 workers + 1 PS, global steps/s"
        peer = "TF ParameterServerStrategy 2 workers + 1 PS"
        rows.append(row(measure, result["sf_2w1ps_steps_per_s"], peer, result["tf_2w1ps_steps_per_s"], target=">= 3"))
    measure = "async 1 worker + 1 PS, global steps/s"
    peer = "single-process PyTorch loop"
    rows.append(row(measure, result["sf_1w1ps_steps_per_s"], peer, result["local_steps_per_s"], target=">= 0.7"))
    measure = "sync 2 workers + 1 PS, global steps/s"
    peer = "PyTorch DDP (gloo), 2 processes"
    rows.append(
        row(measure, result["sf_sync_2w1ps_steps_per_s"], peer, result["ddp_gloo_2_steps_per_s"], target=">= 1")
    )
    measure = "async 2w+1PS with a checkpoint every 100 steps, global steps/s"
    peer = "the same job without"
    rows.append(row(measure, result["sf_2w1ps_checkpoint_every_100_steps_per_s"], peer, result["sf_2w1ps_steps_per_s"]))
    return rows


if __name__ == "__main__":
    main()
