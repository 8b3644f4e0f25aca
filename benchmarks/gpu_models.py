"""The models of the GPU-worker figures (issue 21) and their synthetic data: one definition for shardflow's job
(jobs/gpu_model.py) and the one-process PyTorch loop beside it (gpu_training.py).

- rec: 4 embedding tables of `rows` x 32 (1M rows by default), their rows concatenated into an MLP 128-512-256-1,
  binary cross-entropy, batch 2048, ids uniform over each table; Adagrad everywhere, tables included.
- dense: MLP 1024-2048-2048-10 (6.3M parameters, 25 MB), cross-entropy, batch 512, SGD.
- mlp: the MLP of the PS-training figures (mlp.py: 64-512-512-10, batch 32, SGD), the issue's CPU target.

Each process reads NUM_BATCHES batches of its own seed in a cycle, built on the CPU as an input pipeline yields them.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

NUM_TABLES, TABLE_DIM, REC_ROWS = 4, 32, 1_000_000
REC_HIDDEN = (512, 256)
DENSE_WIDTHS = (1024, 2048, 2048, 10)
BATCH = {"rec": 2048, "dense": 512, "mlp": 32}
MODELS = tuple(BATCH)
NUM_BATCHES = 16
LR = {"rec": 0.05, "dense": 0.01, "mlp": 0.01}
INITIAL_ACCUMULATOR = 0.1
INIT_LOW, INIT_HIGH = -0.05, 0.05


def mlp(widths: tuple[int, ...]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class RecModel(torch.nn.Module):
    """The tables (`tables(rows, dim)` makes each: sf.nn.Embedding for shardflow, nn.Embedding(sparse=True) in one
    process) and the MLP head on their concatenated rows."""

    def __init__(self, tables: list[torch.nn.Module]) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)
        self.head = mlp((NUM_TABLES * TABLE_DIM, *REC_HIDDEN, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = [table(ids[:, k]) for k, table in enumerate(self.tables)]
        return self.head(torch.cat(rows, dim=1)).squeeze(1)


def local_rec_model(rows: int) -> RecModel:
    """The rec model of one process: nn.Embedding(sparse=True) tables initialised as the PS initialise sf.nn's."""
    torch.manual_seed(0)
    tables = [torch.nn.Embedding(rows, TABLE_DIM, sparse=True) for _ in range(NUM_TABLES)]
    with torch.no_grad():
        for table in tables:
            table.weight.uniform_(INIT_LOW, INIT_HIGH)
    return RecModel(tables)


def dense_model(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp(DENSE_WIDTHS if model == "dense" else (64, 512, 512, 10))


def batches(model: str, seed: int, rows: int = REC_ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """NUM_BATCHES (input, label) batches of `model`: rec ids uniform over `rows`, else features N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    count = NUM_BATCHES * BATCH[model]
    if model == "rec":
        x = torch.randint(0, rows, (count, NUM_TABLES), generator=generator)
        y = (torch.rand(count, generator=generator) < 0.3).float()
    else:
        x = torch.randn(count, DENSE_WIDTHS[0] if model == "dense" else 64, generator=generator)
        y = torch.randint(0, 10, (count,), generator=generator)
    size = BATCH[model]
    return [(x[i : i + size], y[i : i + size]) for i in range(0, count, size)]


def loss(model_name: str, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    x, y = batch
    if model_name == "rec":
        return torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    return torch.nn.functional.cross_entropy(model(x), y)
