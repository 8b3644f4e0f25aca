"""The click-through model of the embedding-table figures and its synthetic click logs: one definition for shardflow's
job (jobs/click_through.py), the one-process PyTorch loop (embedding_tables.py) and TensorFlow's peer
(peers/tf_embedding.py). NumPy only at import, so that the TensorFlow peer does not load torch.

Each example: one item id of a 10M-row table (dim 16), Zipf-like (P(k-th most clicked) ~ 1/k, the ranks scattered
over the table), a category (1,000 x 8), a bag of 4 tags (10,000 x 8, mean), 8 dense features and a click. The
head: MLP 40-64-32-1 on the concatenation, binary cross-entropy. Adagrad everywhere, tables included.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

NUM_ITEMS, ITEM_DIM = 10_000_000, 16
NUM_CATEGORIES, CATEGORY_DIM = 1_000, 8
NUM_TAGS, TAG_DIM, TAGS_PER_EXAMPLE = 10_000, 8, 4
NUM_DENSE = 8
HIDDEN = (64, 32)
WIDTH = ITEM_DIM + CATEGORY_DIM + TAG_DIM + NUM_DENSE
BATCH = 512
NUM_BATCHES = 256
"""Batches in each process's click log, read in a cycle."""
LR, INITIAL_ACCUMULATOR, EPS = 0.05, 0.1, 1e-10
"""Adagrad's: acc += g * g; w -= LR * g / (sqrt(acc) + EPS), as torch.optim.Adagrad and TF's sparse kernel."""
INIT_LOW, INIT_HIGH = -0.05, 0.05
"""Every table's rows start uniform in [-0.05, 0.05), as Keras' Embedding."""
_SCATTER = 2_654_435_761
"""Odd and not a multiple of 5, so coprime to 10M: rank * _SCATTER mod NUM_ITEMS is a bijection of the ids."""


def click_log(seed: int, num_batches: int = NUM_BATCHES) -> dict[str, np.ndarray]:
    """`num_batches` batches of examples: item, category, tags (a bag of 4), dense, click."""
    rng = np.random.default_rng(seed)
    count = num_batches * BATCH
    # exp(u ln N) - 1: rank k drawn with probability ~ 1 / ((k + 1) ln N), Zipf with exponent 1 over N ranks.
    ranks = np.exp(rng.random(count) * np.log(NUM_ITEMS)).astype(np.int64) - 1
    items = (ranks * _SCATTER) % NUM_ITEMS
    categories = (np.exp(rng.random(count) * np.log(NUM_CATEGORIES)).astype(np.int64) - 1) % NUM_CATEGORIES
    tags = rng.integers(0, NUM_TAGS, (count, TAGS_PER_EXAMPLE))
    dense = rng.standard_normal((count, NUM_DENSE), dtype=np.float32)
    # Clicks a model can learn: more likely for some items and categories, and with the first dense feature.
    logit = -1.0 + 1.5 * ((items * 7 + categories) % 5 == 0) + dense[:, 0]
    clicks = (rng.random(count) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"item": items, "category": categories, "tags": tags, "dense": dense, "click": clicks}


def torch_batches(seed: int) -> list[dict[str, Any]]:
    """The click log of `seed` as batches of torch tensors (views of one tensor per feature)."""
    import torch

    log = {key: torch.from_numpy(value) for key, value in click_log(seed).items()}
    return [{key: value[i : i + BATCH] for key, value in log.items()} for i in range(0, len(log["item"]), BATCH)]


def torch_head() -> Any:
    """The MLP head as a torch module (torch imported here: the TensorFlow peer never calls it)."""
    import torch

    widths = (WIDTH, *HIDDEN)
    layers: list[torch.nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 1))
