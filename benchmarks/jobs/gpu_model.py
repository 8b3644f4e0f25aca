"""Benchmark job: a model of gpu_models.py on a local shardflow cluster, its workers on DEVICE.

Usage: python gpu_model.py RESULT_JSON MODEL WORKERS PS STEPS MODE DEVICE REC_ROWS REC_TABLES [FIRST,LAST MODEL_DIR]

With FIRST,LAST and MODEL_DIR, the job captures global steps FIRST to LAST with torch's ops (profile_ops) into
MODEL_DIR/profile/, for `shardflow profile steps MODEL_DIR`.

REC_TABLES: sfnn (sf.nn.Embedding, rows only on the PS) or sparse (nn.Embedding(sparse=True), row-sparse variables).
Writes global steps/s once every worker is past its first WARMUP_STEPS steps and over the whole training time, the
global step, each worker's steps and the PS's stats.
"""

import glob
import json
import os
import sys
import tempfile
import time

import torch

import shardflow as sf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_models as gm

result_path, model_name = sys.argv[1], sys.argv[2]
num_workers, num_ps, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
mode, device, rec_rows, rec_tables = sys.argv[6], sys.argv[7], int(sys.argv[8]), sys.argv[9]
profile_steps = tuple(int(step) for step in sys.argv[10].split(",")) if len(sys.argv) > 11 else None
WARMUP_STEPS = 20


def model_fn() -> torch.nn.Module:
    if model_name != "rec":
        return gm.dense_model(model_name)
    if rec_tables == "sparse":
        return gm.local_rec_model(rec_rows)
    uniform = sf.nn.Initializer(kind="uniform", low=gm.INIT_LOW, high=gm.INIT_HIGH)
    torch.manual_seed(0)
    return gm.RecModel([sf.nn.Embedding(rec_rows, gm.TABLE_DIM, initializer=uniform) for _ in range(gm.NUM_TABLES)])


def input_fn(ctx: sf.InputContext):
    batches = gm.batches(model_name, ctx.worker_index, rec_rows)
    while True:
        yield from batches


def loss_fn(model, batch):
    return gm.loss(model_name, model, batch)


class StepLog(sf.Hook):
    """Each worker writes RESULT_JSON.steps.<index>: [perf_counter, global step] after every step."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []

    def after_step(self, info: sf.StepInfo) -> None:
        self.steps.append((time.perf_counter(), info.global_step))

    def end(self, info: sf.StepInfo) -> None:
        with open(f"{result_path}.steps.{info.worker_index}", "w") as f:
            json.dump(self.steps, f)


def steady_steps_per_s() -> float:
    """Global steps/s from the moment every worker has made its warm-up steps to the last step of any."""
    logs = []
    for path in glob.glob(f"{result_path}.steps.*"):
        with open(path) as f:
            logs.append(json.load(f))
        os.remove(path)
    # A short run (a smoke test, many workers) warms up for a quarter of its shortest worker's steps instead.
    warmup = min(WARMUP_STEPS, min(len(log) for log in logs) // 4)
    started = max(log[warmup][0] for log in logs)
    after = sorted(entry for log in logs for entry in log if entry[0] >= started)
    (t0, step0), (t1, step1) = after[0], max(after, key=lambda entry: entry[1])
    return (step1 - step0) / (t1 - t0)


if model_name == "rec":
    optimizer = sf.optim.Adagrad(lr=gm.LR["rec"], initial_accumulator_value=gm.INITIAL_ACCUMULATOR)
else:
    optimizer = sf.optim.SGD(lr=gm.LR[model_name])
strategy = sf.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, mode=mode, device=device)
with tempfile.TemporaryDirectory() as scratch:
    model_dir = sys.argv[11] if profile_steps else scratch
    profiling = {"profile_steps": profile_steps, "profile_ops": True} if profile_steps else {}
    est = sf.Estimator(model_fn, loss_fn, optimizer, strategy, model_dir, **profiling)
    result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=steps, hooks=[StepLog()]))
with open(result_path, "w") as f:
    json.dump(
        {
            "global_step": result.global_step,
            "steps_per_s": steady_steps_per_s(),
            "training_steps_per_s": result.global_steps_per_s,
            "training_s": result.training_s,
            "worker_steps": result.worker_steps,
            "first_loss": result.first_loss,
            "final_loss": result.final_loss,
            "ps_stats": result.ps_stats,
        },
        f,
    )
