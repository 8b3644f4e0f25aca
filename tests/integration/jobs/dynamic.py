"""A job whose only table is an `sf.nn.DynamicEmbedding` of hashed ids from a 2^62 space, Zipf-distributed (a few
ids very frequent, most seen once), configured by the JSON file in argv[1]. The test imports it for the stream of
ids, to count each id's sightings itself.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch

import shardflow as sf

IDS_PER_EXAMPLE = 32


def make_ids(num_batches: int, batch: int, num_ranks: int) -> np.ndarray:
    """[num_batches * batch, IDS_PER_EXAMPLE] int64 ids: Zipf ranks (exponent 1.1) over `num_ranks`, each rank
    hashed to a 62-bit id as a feature hash would."""
    rng = np.random.default_rng(5)
    ranks = rng.zipf(1.1, size=(num_batches * batch, IDS_PER_EXAMPLE)) % num_ranks
    mixed = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0xD1B54A32D192ED03)
    return (mixed >> np.uint64(2)).astype(np.int64)


class Model(torch.nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.users = sf.nn.DynamicEmbedding(
            8,
            admit_after=config.get("admit_after", 2),
            expire_after_steps=config.get("expire_after_steps"),
            capacity_per_ps=config.get("capacity_per_ps"),
            # Millions of ids are seen once: every one is counted until it is seen again.
            max_pending_per_ps=config.get("max_pending_per_ps", 1 << 21),
            optimizer=sf.nn.rowwise_adagrad(lr=0.05),
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids).mean(dim=1))


def main(config: dict[str, Any]) -> None:
    num_batches, batch = config["num_batches"], config["batch"]
    ids = make_ids(num_batches, batch, config["num_ranks"])

    def input_fn(ctx: sf.InputContext):
        for b in range(ctx.worker_index, num_batches, ctx.num_workers):
            rows = ids[b * batch : (b + 1) * batch]
            yield {"ids": rows, "target": np.ones((batch, 1), np.float32)}

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch["ids"]), batch["target"])

    strategy = sf.ParameterServerStrategy(num_ps=2, num_workers=config.get("num_workers", 2), mode="async")
    profile_steps = config.get("profile_steps")
    est = sf.Estimator(
        lambda: Model(config),
        loss_fn,
        sf.optim.Adagrad(lr=0.05),
        strategy,
        config["model_dir"],
        profile_steps=tuple(profile_steps) if profile_steps else None,
    )
    result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, epochs=1))
    with open(config["result"], "w") as f:
        json.dump({"global_step": result.global_step, "ps_stats": result.ps_stats, "checkpoint": result.checkpoint}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
