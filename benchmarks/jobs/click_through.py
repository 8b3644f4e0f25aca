"""Benchmark job: the click-through model of click_model.py with `sf.nn` tables (the 10M-row item table lives only on
the PS), Adagrad, batch 512 per worker, on a local shardflow cluster.

Usage: python click_through.py RESULT_JSON WORKERS PS STEPS

Writes global steps/s once every worker is past its first WARMUP_STEPS steps (as the peers time theirs after a
warm-up) and over the whole training time, the global step, each worker's steps, the PS's stats (with each table's
rows and bytes) and, from the click log each worker read, what a step looks up: unique ids per table, per PS.
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
import click_model as cm

result_path, num_workers, num_ps, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
WARMUP_STEPS = 30


class ClickModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        uniform = sf.nn.Initializer(kind="uniform", low=cm.INIT_LOW, high=cm.INIT_HIGH)
        self.item = sf.nn.Embedding(cm.NUM_ITEMS, cm.ITEM_DIM, initializer=uniform)
        self.category = sf.nn.Embedding(cm.NUM_CATEGORIES, cm.CATEGORY_DIM, initializer=uniform)
        self.tags = sf.nn.EmbeddingBag(cm.NUM_TAGS, cm.TAG_DIM, mode="mean", initializer=uniform)
        self.head = cm.torch_head()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # Each table reads a tensor of the batch itself: the worker looks its rows up ahead, for the next batch.
        features = [self.item(batch["item"]), self.category(batch["category"]), self.tags(batch["tags"])]
        return self.head(torch.cat([*features, batch["dense"]], dim=1)).squeeze(1)


def model_fn() -> torch.nn.Module:
    torch.manual_seed(0)
    return ClickModel()


def input_fn(ctx: sf.InputContext):
    log = cm.torch_batches(ctx.worker_index)
    while True:
        yield from log


def loss_fn(model, batch):
    return torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch["click"])


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
    """Global steps/s from the moment every worker has made WARMUP_STEPS steps to the last step of any."""
    logs = []
    for path in glob.glob(f"{result_path}.steps.*"):
        with open(path) as f:
            logs.append(json.load(f))
        os.remove(path)
    started = max(log[min(WARMUP_STEPS, len(log) - 1)][0] for log in logs)
    after = sorted(entry for log in logs for entry in log if entry[0] >= started)
    (t0, step0), (t1, step1) = after[0], max(after, key=lambda entry: entry[1])
    return (step1 - step0) / (t1 - t0)


def unique_ids_per_step() -> dict[str, list[float]]:
    """Per table, the mean number of unique ids a worker's batch looks up on each PS (ids modulo the PS count, the
    tables' partition), over the click logs the workers read."""
    batches = [batch for worker in range(num_workers) for batch in cm.torch_batches(worker)]
    found: dict[str, list[float]] = {}
    for name in ("item", "category", "tags"):
        per_ps = torch.zeros(num_ps, dtype=torch.float64)
        for batch in batches:
            per_ps += torch.bincount(torch.unique(batch[name]) % num_ps, minlength=num_ps)
        found[name] = (per_ps / len(batches)).tolist()
    return found


strategy = sf.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, mode="async")
optimizer = sf.optim.Adagrad(lr=cm.LR, initial_accumulator_value=cm.INITIAL_ACCUMULATOR, eps=cm.EPS)
with tempfile.TemporaryDirectory() as model_dir:
    est = sf.Estimator(model_fn, loss_fn, optimizer, strategy, model_dir)
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
            "unique_ids_per_step": unique_ids_per_step(),
        },
        f,
    )
