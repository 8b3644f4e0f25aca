"""A real training job that audits its own data: which records' gradients were applied, and how many times.

Each record has an id. Besides a small regression model, the model holds `seen`, one counter per record id, and the loss
adds -seen[id] for every record of the batch: with SGD at lr 1/16 and that term scaled by 16, every applied gradient of
a record adds exactly 1.0 to its counter (powers of two: no rounding). So the final parameters say how many times each
record's gradient was applied, whatever was killed on the way. `seen` is cut across the PS, so a push that reached only
some PS shows. With "dynamic", an `sf.nn.DynamicEmbedding` keyed by a hash of each record's id counts the same way, in
rows made on the PS as records arrive. With "mode": "allreduce" the job trains with sf.AllReduceStrategy (no PS, `seen`
is dense): each record's gradient is averaged over the 2 workers, so an applied one adds 0.5. With "mode": "hybrid",
sf.HybridStrategy on 2 PS ("sparse_mode" async by default): `seen` is all-reduced (0.5 a record) and the dynamic table,
always there, lives on the PS, whose async rows add 1.0 a record (sync: their mean over the workers with a batch, 0.5).
Configured by a JSON file given as argv[1] (see regression.py's keys; "step_log": a file that gets a line per batch, for
a test to see training under way).
"""

import json
import os
import sys
import time

import torch

import shardflow as sf
from shardflow.train.estimator import Preempted

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_RECORDS = config.get("num_records", 1024)
BATCH = config.get("batch", 8)
LR = 1.0 / 16
generator = torch.Generator().manual_seed(7)
X = torch.randn(NUM_RECORDS, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
DYNAMIC = config.get("dynamic", False) or config.get("mode") == "hybrid"


def hashed(ids: torch.Tensor) -> torch.Tensor:
    """Each record's id spread over 62 bits, as a hashed feature is: the dynamic table's ids."""
    return (ids * 0x9E3779B97F4A7C1 + 12345) & ((1 << 62) - 1)


def input_fn(ctx: sf.InputContext):
    ids = torch.arange(NUM_RECORDS)
    for b in range(ctx.worker_index, NUM_RECORDS // BATCH, ctx.num_workers):
        batch = ids[b * BATCH : (b + 1) * BATCH]
        yield (batch, X[batch], Y[batch], hashed(batch)) if DYNAMIC else (batch, X[batch], Y[batch])


class Audited(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.nn.Parameter(torch.zeros(NUM_RECORDS))
        self.head = torch.nn.Linear(4, 1)
        zeros = sf.nn.Initializer(kind="zeros")
        self.seen_hashed = sf.nn.DynamicEmbedding(1, initializer=zeros, optimizer=sf.nn.sgd(LR)) if DYNAMIC else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


TASK = json.loads(os.environ.get("SHARDFLOW_CLUSTER", "{}")).get("task", {})
NAN_AT = config.get("nan_at")
"""[worker index, first record id of a batch]: that batch's loss is NaN (a bad record, as users meet them)."""


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    assert isinstance(model, Audited)
    ids, x, y = batch[:3]
    time.sleep(config.get("step_delay_s", 0))
    if config.get("step_log"):
        with open(config["step_log"], "a") as log:
            log.write("step\n")
    loss = torch.nn.functional.mse_loss(model(x), y) * 0.05 - model.seen[ids].sum() / LR
    if model.seen_hashed is not None:
        loss = loss - model.seen_hashed(batch[3]).sum() / LR
    if NAN_AT is not None and [TASK.get("index"), int(ids[0])] == NAN_AT:
        loss = loss * float("nan")
    return loss


# Every strategy's settings for its roles' loss, hang and restart.
ROLES = {
    "heartbeat_timeout_s": config.get("heartbeat_timeout_s", 10.0),
    "worker_rejoin_timeout_s": config.get("worker_rejoin_timeout_s", 120.0),
    "hung_timeout_s": config.get("hung_timeout_s", 30.0),
    "max_restarts": config.get("max_restarts", 3),
    "restart_backoff_s": config.get("restart_backoff_s", 0.5),
    "request_timeout_s": config.get("request_timeout_s", 60.0),
}
strategy: sf.ParameterServerStrategy | sf.AllReduceStrategy
if config.get("mode") == "hybrid":
    strategy = sf.HybridStrategy(
        num_ps=config.get("num_ps", 2),
        num_workers=config.get("num_workers", 2),
        sparse_mode=config.get("sparse_mode", "async"),
        **ROLES,
    )
elif config.get("mode") == "allreduce":
    strategy = sf.AllReduceStrategy(
        num_workers=config.get("num_workers", 2), gradient_accumulation_steps=config.get("accumulation", 1), **ROLES
    )
else:
    strategy = sf.ParameterServerStrategy(
        num_ps=config.get("num_ps", 2),
        num_workers=config.get("num_workers", 2),
        mode=config.get("mode", "async"),
        overlap=config.get("overlap", True),
        # `seen` (4 KB) is cut across every PS.
        partitioner=sf.Partitioner(min_slice_bytes=256),
        lost_worker_policy=config.get("lost_worker_policy", "wait"),
        max_nonfinite_updates=config.get("max_nonfinite_updates", 1),
        **ROLES,
    )
est = sf.Estimator(
    Audited,
    loss_fn,
    sf.optim.SGD(lr=LR),
    strategy,
    config["model_dir"],
    save_checkpoints_steps=config.get("save_checkpoints_steps"),
)


def write_result(result: sf.TrainResult) -> None:
    with open(config["result"], "w") as f:
        json.dump(
            {
                "global_step": result.global_step,
                "start_step": result.start_step,
                "worker_steps": result.worker_steps,
                "ps_stats": result.ps_stats,
                "checkpoint": result.checkpoint,
                "preempted": result.preempted,
            },
            f,
        )


try:
    trained = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, epochs=config.get("epochs", 1)))
except Preempted as preempted:
    write_result(preempted.result)
    raise
write_result(trained)
