"""A small real training job for integration tests, configured by a JSON file given as argv[1].

Worker w reads batches w, w + num_workers, w + 2*num_workers, ... of a fixed regression data set,
so the cluster as a whole reads each batch once per epoch.
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
NUM_BATCHES = config.get("num_batches", 100)
BATCH = config.get("batch", 8)
generator = torch.Generator().manual_seed(123)
X = torch.randn(NUM_BATCHES * BATCH, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(NUM_BATCHES * BATCH, 1, generator=generator)


def input_fn(ctx: sf.InputContext):
    for b in range(ctx.worker_index, NUM_BATCHES, ctx.num_workers):
        yield X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, config.get("hidden", 16)),
        torch.nn.Tanh(),
        torch.nn.Linear(config.get("hidden", 16), 1),
    )


log_path = config.get("step_log")
TASK = json.loads(os.environ.get("SHARDFLOW_CLUSTER", "{}")).get("task", {})


def loss_fn(model, batch):
    x, y = batch
    if log_path:
        # One line per step start: the SSP test checks how far ahead each worker ran.
        with open(log_path, "a") as f:
            f.write(json.dumps({"worker": TASK.get("index"), "t": time.monotonic()}) + "\n")
    time.sleep(config.get("step_delay_s", 0))
    slow = config.get("slow_worker_delay_s")
    if slow and TASK.get("index") == 1:
        time.sleep(slow)
    # "reduction": "none" is the mistake a user makes: a per-example loss.
    return torch.nn.functional.mse_loss(model(x), y, reduction=config.get("reduction", "mean"))


strategy = sf.ParameterServerStrategy(
    num_ps=config.get("num_ps", 1),
    num_workers=config.get("num_workers", 2),
    mode=config.get("mode", "async"),
    max_staleness=config.get("max_staleness", 2),
    replicas_to_aggregate=config.get("replicas_to_aggregate"),
    overlap=config.get("overlap", True),
    request_timeout_s=config.get("request_timeout_s", 60.0),
    termination_grace_s=config.get("termination_grace_s", 30.0),
    max_restarts=config.get("max_restarts", 3),
    wire_dtype=config.get("wire_dtype"),
)
profile_steps = config.get("profile_steps")
est = sf.Estimator(
    model_fn,
    loss_fn,
    sf.optim.SGD(lr=config.get("lr", 0.05)),
    strategy,
    config["model_dir"],
    profile_steps=tuple(profile_steps) if profile_steps else None,
    profile_ops=config.get("profile_ops", False),
)


def write_result(result: sf.TrainResult) -> None:
    with open(config["result"], "w") as f:
        json.dump(
            {
                "global_step": result.global_step,
                "start_step": result.start_step,
                "worker_steps": result.worker_steps,
                "ps_stats": result.ps_stats,
                "est_global_step": est.global_step,
                "profile_dir": result.profile_dir,
                "checkpoint": result.checkpoint,
                "preempted": result.preempted,
            },
            f,
        )


try:
    trained = sf.train_and_evaluate(
        est, sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=config.get("epochs"))
    )
except Preempted as preempted:
    write_result(preempted.result)
    raise  # exits 143: the job is not finished; running it again resumes from the checkpoint
write_result(trained)
