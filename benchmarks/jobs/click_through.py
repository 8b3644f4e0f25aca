"""Benchmark job: the click-through model of click_model.py with `sf.nn` tables (the 10M-row item table lives only on
the PS), Adagrad, batch 512 per worker, on a local shardflow cluster.

Usage: python click_through.py RESULT_JSON WORKERS PS STEPS [MODE]

MODE: async (the default) or sync, ParameterServerStrategy with sf.nn tables; hybrid, HybridStrategy (the sf.nn
tables on the PS, async, the head all-reduced); or allreduce, AllReduceStrategy with
PS 0, which refuses sf.nn tables and sparse embeddings: the same tables as dense torch.nn.Embedding and EmbeddingBag
(sparse=False), every worker holding all of them and all-reducing their whole gradient each step.

Writes global steps/s once every worker is past its first WARMUP_STEPS steps (as the peers time theirs after a
warm-up) and over the whole training time, the global step, each worker's steps, the PS's stats (with each table's
rows and bytes) and, from the click log each worker read, what a step looks up: unique ids per table, per PS.
"""

import json
import os
import sys
import tempfile
import time

import torch

import shardflow as sf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import click_model as cm
from step_log import read_step_logs, steady_steps_per_s

result_path, num_workers, num_ps, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "async"
WARMUP_STEPS = min(30, steps // 3)


class ClickModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        if mode == "allreduce":
            self.item, self.category, self.tags = dense_tables()
        else:
            uniform = sf.nn.Initializer(kind="uniform", low=cm.INIT_LOW, high=cm.INIT_HIGH)
            self.item = sf.nn.Embedding(cm.NUM_ITEMS, cm.ITEM_DIM, initializer=uniform)
            self.category = sf.nn.Embedding(cm.NUM_CATEGORIES, cm.CATEGORY_DIM, initializer=uniform)
            self.tags = sf.nn.EmbeddingBag(cm.NUM_TAGS, cm.TAG_DIM, mode="mean", initializer=uniform)
        self.head = cm.torch_head()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # Each table reads a tensor of the batch itself: the worker looks its rows up ahead, for the next batch.
        features = [self.item(batch["item"]), self.category(batch["category"]), self.tags(batch["tags"])]
        return self.head(torch.cat([*features, batch["dense"]], dim=1)).squeeze(1)


def dense_tables() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """The three tables as dense torch modules, rows uniform as the sf.nn tables' initializer."""
    tables = (
        torch.nn.Embedding(cm.NUM_ITEMS, cm.ITEM_DIM),
        torch.nn.Embedding(cm.NUM_CATEGORIES, cm.CATEGORY_DIM),
        torch.nn.EmbeddingBag(cm.NUM_TAGS, cm.TAG_DIM, mode="mean"),
    )
    with torch.no_grad():
        for table in tables:
            table.weight.uniform_(cm.INIT_LOW, cm.INIT_HIGH)
    return tables


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
    """Each worker writes RESULT_JSON.steps.<index>: [perf_counter, global step] after every step, at the last
    step as well as at the end: a job that then fails (all-reduce, when its final checkpoint does not fit the
    control store) still leaves the timing of the steps it trained."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []

    def after_step(self, info: sf.StepInfo) -> None:
        self.steps.append((time.perf_counter(), info.global_step))
        if info.global_step >= steps:
            self.end(info)

    def end(self, info: sf.StepInfo) -> None:
        with open(f"{result_path}.steps.{info.worker_index}", "w") as f:
            json.dump(self.steps, f)


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


strategy: sf.AllReduceStrategy | sf.ParameterServerStrategy
if mode == "allreduce":
    strategy = sf.AllReduceStrategy(num_workers=num_workers)
elif mode == "hybrid":  # the sf.nn tables on the PS (async), the head all-reduced
    strategy = sf.HybridStrategy(num_ps=num_ps, num_workers=num_workers, sparse_mode="async")
else:
    strategy = sf.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, mode=mode)
optimizer = sf.optim.Adagrad(lr=cm.LR, initial_accumulator_value=cm.INITIAL_ACCUMULATOR, eps=cm.EPS)
with tempfile.TemporaryDirectory() as model_dir:
    est = sf.Estimator(model_fn, loss_fn, optimizer, strategy, model_dir)
    result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=steps, hooks=[StepLog()]))
with open(result_path, "w") as f:
    json.dump(
        {
            "global_step": result.global_step,
            "steps_per_s": steady_steps_per_s(read_step_logs(f"{result_path}.steps"), WARMUP_STEPS),
            "training_steps_per_s": result.global_steps_per_s,
            "training_s": result.training_s,
            "worker_steps": result.worker_steps,
            "first_loss": result.first_loss,
            "final_loss": result.final_loss,
            "ps_stats": result.ps_stats,
            "unique_ids_per_step": unique_ids_per_step() if num_ps else {},
        },
        f,
    )
