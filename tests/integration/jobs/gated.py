"""A small real training job whose workers wait at a gate before their last batches: a test acts on the running
job for as long as it needs, opens the gate (creates the file), and still knows the final global step.

Configured by a JSON file given as argv[1]: model_dir, result, gate (a path), num_batches, num_workers, gate_at
(each worker's batches before the gate), step_delay_s, request_timeout_s. Async, one PS, one epoch: the global
step ends at num_batches.
"""

import json
import sys
import time
from pathlib import Path

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_BATCHES, BATCH = config["num_batches"], 8
GATE = Path(config["gate"])
GATE_TIMEOUT_S = 120
generator = torch.Generator().manual_seed(123)
X = torch.randn(NUM_BATCHES * BATCH, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def input_fn(ctx: sf.InputContext):
    for index, b in enumerate(range(ctx.worker_index, NUM_BATCHES, ctx.num_workers)):
        if index == config["gate_at"]:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not GATE.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker:{ctx.worker_index} waited {GATE_TIMEOUT_S}s for the gate {GATE}")
                time.sleep(0.05)
        time.sleep(config["step_delay_s"])
        yield X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


strategy = sf.ParameterServerStrategy(
    num_ps=1, num_workers=config["num_workers"], mode="async", request_timeout_s=config["request_timeout_s"]
)
est = sf.Estimator(model_fn, loss_fn, sf.optim.SGD(lr=0.01), strategy, config["model_dir"])
result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, epochs=1))
with open(config["result"], "w") as f:
    json.dump({"global_step": result.global_step, "ps_stats": result.ps_stats}, f)
