"""AllReduceStrategy with 2 workers against raw DDP with gloo on the benchmark MLP, alternating (target >= 0.95x).

The MLP 64-512-512-10, batch 32 per worker, SGD; DistributedDataParallel with gloo in 2 processes (peers/ddp_sync.py).

Both are timed after 50 untimed steps: DDP between two barriers, shardflow from its workers' step logs (the job's
own rate would count its start and its final checkpoint). One step is one batch on every worker in both; both give
each process one of the machine's cores per process.

Usage: python benchmarks/allreduce_vs_ddp.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from ps_training import run_json, shardflow_job
from result_line import print_result, row
from step_log import read_step_logs, steady_steps_per_s

HERE = Path(__file__).parent
WORKERS = 2
WARMUP_STEPS = 50
"""As peers/ddp_sync.py's untimed steps."""


def allreduce_steps_per_s(steps: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        prefix = f"{directory}/steps"
        result = shardflow_job(WORKERS, 0, steps, mode="allreduce", env={"SHARDFLOW_BENCH_STEP_LOG": prefix})
        if result["global_step"] != steps:
            raise RuntimeError(f"the all-reduce job ended at global step {result['global_step']}, not {steps}")
        return steady_steps_per_s(read_step_logs(prefix), WARMUP_STEPS)


def ddp_steps_per_s(steps: int) -> float:
    return float(run_json([str(HERE / "peers" / "ddp_sync.py"), str(WORKERS), str(steps)])["steps_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    allreduce: list[float] = []
    ddp: list[float] = []
    for repeat in range(args.repeats):
        # Each goes first in every other repeat, so that neither always runs on a machine the other just warmed.
        for run in (allreduce, ddp) if repeat % 2 == 0 else (ddp, allreduce):
            run.append(allreduce_steps_per_s(args.steps) if run is allreduce else ddp_steps_per_s(args.steps))
    print(f"shardflow all-reduce 2 workers, global steps/s: {', '.join(f'{v:.0f}' for v in allreduce)}")
    print(f"DDP gloo 2 processes, steps/s: {', '.join(f'{v:.0f}' for v in ddp)}")
    best = max(allreduce) / max(ddp)
    median = statistics.median(allreduce) / statistics.median(ddp)
    print(f"all-reduce vs DDP: {best:.2f}x best against best, {median:.2f}x median against median (target >= 0.95x)")
    figures = {
        "sf_allreduce_2w_steps_per_s": allreduce,
        "ddp_gloo_2_steps_per_s": ddp,
        "ratio_best": best,
        "ratio_median": median,
    }
    measure = "AllReduceStrategy 2 workers, benchmark MLP, global steps/s (best against best)"
    peer = "PyTorch DDP (gloo), 2 processes"
    print_result("allreduce_vs_ddp", figures, [row(measure, max(allreduce), peer, max(ddp), target=">= 0.95")])


if __name__ == "__main__":
    main()
