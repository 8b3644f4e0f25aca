"""Staged runs for the profiler's diagnosis: input-bound, PS-bound or compute-bound by construction.

Usage: python staged.py CONFIG_JSON with {"kind": "input"|"ps"|"compute", "model_dir": ..., "result": ...}.
"""

import json
import sys
import time

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
KIND = config["kind"]
ROWS = 200_000


class Lookup(torch.nn.Module):
    """A large dense table of which each step touches a few rows: tiny compute, 12.8 MB of gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(ROWS, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids))


def model_fn() -> torch.nn.Module:
    if KIND == "ps":
        return Lookup()
    width = 1024 if KIND == "compute" else 16
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


def input_fn(ctx: sf.InputContext):
    batch = 4096 if KIND == "compute" else 8
    generator = torch.Generator().manual_seed(ctx.worker_index)
    for _ in range(60):
        if KIND == "input":
            time.sleep(0.02)  # a slow input pipeline
        if KIND == "ps":
            yield torch.randint(0, ROWS, (batch,), generator=generator), torch.randn(batch, 1, generator=generator)
        else:
            yield torch.randn(batch, 64, generator=generator), torch.randn(batch, 1, generator=generator)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


# PS-bound: async, so the PS applies Adam to the whole table once per push, not once per three.
strategy = sf.ParameterServerStrategy(
    num_ps=1, num_workers=3 if KIND == "ps" else 1, mode="async" if KIND == "ps" else "sync"
)
optimizer = sf.optim.Adam(lr=1e-3) if KIND == "ps" else sf.optim.SGD(lr=1e-3)
est = sf.Estimator(model_fn, loss_fn, optimizer, strategy, config["model_dir"], profile_steps=(10, 30))
result = est.train(input_fn, epochs=1)
with open(config["result"], "w") as f:
    json.dump({"global_step": result.global_step, "profile_dir": result.profile_dir}, f)
