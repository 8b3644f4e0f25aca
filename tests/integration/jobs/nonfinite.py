"""A small regression job in which worker:1's loss or gradients become NaN or inf at chosen local steps; configured
by a JSON file given as argv[1].

"nonfinite_loss_at" and "inf_gradients_at" list worker:1's local steps (counted from 0) whose loss is NaN, or whose
loss is finite but whose gradients are inf.
"""

import json
import os
import sys
import time

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_BATCHES, BATCH = config.get("num_batches", 100), 8
generator = torch.Generator().manual_seed(123)
X = torch.randn(NUM_BATCHES * BATCH, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
TASK = json.loads(os.environ.get("SHARDFLOW_CLUSTER", "{}")).get("task", {})
IS_WORKER_1 = TASK.get("type") == "worker" and TASK.get("index") == 1
local_step = -1


def input_fn(ctx: sf.InputContext):
    for b in range(ctx.worker_index, NUM_BATCHES, ctx.num_workers):
        yield X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(model, batch):
    global local_step
    x, y = batch
    if TASK.get("type") == "worker":
        local_step += 1
    time.sleep(config.get("step_delay_s", 0))
    hidden = model[1](model[0](x))
    if IS_WORKER_1 and local_step in config.get("inf_gradients_at", []):
        hidden.register_hook(lambda grad: grad * float("inf"))
    loss = torch.nn.functional.mse_loss(model[2](hidden), y)
    if IS_WORKER_1 and local_step in config.get("nonfinite_loss_at", []):
        return loss * float("nan")
    return loss


strategy = sf.ParameterServerStrategy(
    num_ps=config.get("num_ps", 2),
    num_workers=2,
    mode=config.get("mode", "async"),
    max_nonfinite_updates=config.get("max_nonfinite_updates", 1),
)
est = sf.Estimator(
    model_fn,
    loss_fn,
    sf.optim.Adam(lr=0.01),
    strategy,
    config["model_dir"],
    save_checkpoints_steps=config.get("save_checkpoints_steps"),
)
result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=config.get("max_steps")))
with open(config["result"], "w") as f:
    json.dump({"global_step": result.global_step, "ps_stats": result.ps_stats}, f)
