"""Benchmark job: MLP 64-512-512-10 (301k parameters), batch 32, on a local shardflow cluster.

Usage: python mlp_async.py RESULT_JSON WORKERS PS STEPS [MODE] [OVERLAP] [SAVE_CHECKPOINTS_STEPS] [FEATURES]

MODE: async or sync (ParameterServerStrategy), or allreduce (AllReduceStrategy: PS must be 0, OVERLAP is ignored).

FEATURES: comma-separated training-loop features to turn on: clip (clip_grad_norm=1.0), bf16 (mixed precision).
"""

import json
import os
import sys
import tempfile
import time

import torch

import shardflow as sf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp import BATCH, NUM_EXAMPLES, mlp, synthetic_data

result_path, num_workers, num_ps, steps = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
)
mode = sys.argv[5] if len(sys.argv) > 5 else "async"
overlap = (sys.argv[6] if len(sys.argv) > 6 else "1") == "1"
save_every = int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "0" else None
features = set(sys.argv[8].split(",")) - {""} if len(sys.argv) > 8 else set()


def model_fn() -> torch.nn.Module:
    return mlp()


def input_fn(ctx: sf.InputContext):
    x, y = synthetic_data(torch.Generator().manual_seed(ctx.worker_index))
    while True:
        for i in range(0, NUM_EXAMPLES, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


class StepLog(sf.Hook):
    """With SHARDFLOW_BENCH_STEP_LOG=PREFIX, each worker writes PREFIX.<index>: [perf_counter, global step] after
    every step (benchmarks/profiler_overhead.py)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.steps: list[tuple[float, int]] = []

    def after_step(self, info: sf.StepInfo) -> None:
        self.steps.append((time.perf_counter(), info.global_step))

    def end(self, info: sf.StepInfo) -> None:
        with open(f"{self.prefix}.{info.worker_index}", "w") as f:
            json.dump(self.steps, f)


step_log = os.environ.get("SHARDFLOW_BENCH_STEP_LOG")
hooks = [StepLog(step_log)] if step_log else []
strategy = (
    sf.AllReduceStrategy(num_workers=num_workers)
    if mode == "allreduce"
    else sf.ParameterServerStrategy(
        num_ps=num_ps,
        num_workers=num_workers,
        mode=mode,
        overlap=overlap,
        mixed_precision="bf16" if "bf16" in features else None,
    )
)
with tempfile.TemporaryDirectory() as model_dir:
    est = sf.Estimator(
        model_fn,
        loss_fn,
        sf.optim.SGD(lr=0.01),
        strategy,
        model_dir,
        save_checkpoints_steps=save_every,
        clip_grad_norm=1.0 if "clip" in features else None,
    )
    result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=steps, hooks=hooks))
with open(result_path, "w") as f:
    json.dump(
        {
            "global_step": result.global_step,
            "steps_per_s": result.global_steps_per_s,
            "training_s": result.training_s,
            "worker_steps": result.worker_steps,
            "profile_dir": result.profile_dir,
        },
        f,
    )
