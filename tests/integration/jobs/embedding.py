"""A job with row-sparse embeddings (nn.Embedding and nn.EmbeddingBag with sparse=True) for integration tests,
configured by the JSON file in argv[1]. The test imports it for the model and data of its single-process reference.

Worker w reads batches w, w + num_workers, ... of a fixed data set of id lookups and targets.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import shardflow as sf

NUM_IDS, NUM_TAGS = 5_000, 100


def make_data(num_batches: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids (3 per example, from a big table), tags (a bag of 4 per example) and targets."""
    generator = torch.Generator().manual_seed(11)
    count = num_batches * batch
    # Small ids are frequent, so batches look up some rows more than once and share rows with each other.
    ids = (torch.rand(count, 3, generator=generator) ** 3 * NUM_IDS).long()
    tags = torch.randint(0, NUM_TAGS, (count, 4), generator=generator)
    return ids, tags, torch.randn(count, 1, generator=generator)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ids = torch.nn.Embedding(NUM_IDS, 16, sparse=True)
        self.tags = torch.nn.EmbeddingBag(NUM_TAGS, 4, mode="mean", sparse=True)
        self.head = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.ids(ids).mean(dim=1), self.tags(tags)], dim=1))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids, tags, targets = batch
    return torch.nn.functional.mse_loss(model(ids, tags), targets)


def one_process(steps: int, batch: int) -> torch.nn.Module:
    """The reference: the same model and torch.optim.Adagrad (lr 0.1) in one process, each step on two workers'
    batches concatenated, as a sync job with 2 workers takes them."""
    ids, tags, targets = make_data(2 * steps, batch)
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for step in range(steps):
        rows = slice(2 * step * batch, (2 * step + 2) * batch)
        optimizer.zero_grad()
        loss_fn(model, (ids[rows], tags[rows], targets[rows])).backward()
        optimizer.step()
    return model


def main(config: dict[str, Any]) -> None:
    num_batches, batch = config.get("num_batches", 40), config.get("batch", 8)
    ids, tags, targets = make_data(num_batches, batch)

    def input_fn(ctx: sf.InputContext):
        for b in range(ctx.worker_index, num_batches, ctx.num_workers):
            rows = slice(b * batch, (b + 1) * batch)
            # "ids_dtype": "int32" is what make_csv_dataset infers, and plain PyTorch accepts.
            yield ids[rows].to(getattr(torch, config.get("ids_dtype", "int64"))), tags[rows], targets[rows]

    optimizer = getattr(sf.optim, config.get("optimizer", "Adagrad"))(lr=config.get("lr", 0.1))
    strategy = sf.ParameterServerStrategy(
        num_ps=config.get("num_ps", 2),
        num_workers=config.get("num_workers", 2),
        mode=config.get("mode", "sync"),
        device=config.get("device"),
        # Small slices, so the id table is cut across every PS (differently on 2 and on 3 PS).
        partitioner=sf.Partitioner(min_slice_bytes=4 << 10),
    )
    profile_steps = config.get("profile_steps")
    est = sf.Estimator(
        Model,
        loss_fn,
        optimizer,
        strategy,
        config["model_dir"],
        profile_steps=tuple(profile_steps) if profile_steps else None,
    )
    result = sf.train_and_evaluate(
        est, sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=config.get("epochs", 1))
    )
    with open(config["result"], "w") as f:
        fields = ("global_step", "start_step", "profile_dir")
        json.dump({name: getattr(result, name) for name in fields}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
