"""The MLP of the PS-training figures (64-512-512-10, 301k parameters) and its synthetic data: one definition for
shardflow's job (jobs/mlp_async.py) and the peers that run beside it (the local loop, peers/ddp_sync.py)."""

from __future__ import annotations

import torch

BATCH = 32
NUM_EXAMPLES = 4096


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def synthetic_data(generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4096 random inputs and class labels, read in batches of 32."""
    x = torch.rand(NUM_EXAMPLES, 64, generator=generator)
    y = torch.randint(0, 10, (NUM_EXAMPLES,), generator=generator)
    return x, y
