"""`sf.nn`: embedding tables that live only on the parameter servers (docs/embeddings.md).

self.items = sf.nn.Embedding(50_000_000, 64)                  # fixed rows, partitioned over the PS
self.users = sf.nn.DynamicEmbedding(64, admit_after=2)         # any int64 id, rows made on admission
self.tags = sf.nn.EmbeddingBag(10_000, 16, mode="mean")
"""

from __future__ import annotations

from shardflow.nn.local import LocalTables, local_tables
from shardflow.nn.modules import DynamicEmbedding, Embedding, EmbeddingBag, table_specs
from shardflow.ps.embeddings.spec import Initializer, RowOptimizer

__all__ = [
    "DynamicEmbedding",
    "Embedding",
    "EmbeddingBag",
    "Initializer",
    "LocalTables",
    "RowOptimizer",
    "adagrad",
    "lazy_adam",
    "local_tables",
    "rowwise_adagrad",
    "sgd",
    "table_specs",
]


def sgd(lr: float = 0.01) -> RowOptimizer:
    """Plain SGD on the rows a step touched."""
    return RowOptimizer(name="sgd", lr=lr)


def adagrad(
    lr: float = 0.01, eps: float = 1e-10, initial_accumulator_value: float = 0.0, lr_decay: float = 0.0
) -> RowOptimizer:
    """Adagrad, one accumulator per element, as torch.optim.Adagrad on a sparse gradient."""
    return RowOptimizer(
        name="adagrad", lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value, lr_decay=lr_decay
    )


def rowwise_adagrad(lr: float = 0.01, eps: float = 1e-10, initial_accumulator_value: float = 0.0) -> RowOptimizer:
    """Adagrad with one accumulator per row (the mean squared gradient of the row): a dim-th of the state."""
    return RowOptimizer(name="rowwise_adagrad", lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value)


def lazy_adam(
    lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, per_row_steps: bool = False
) -> RowOptimizer:
    """Adam on the rows a step touched only (torch.optim.SparseAdam); `per_row_steps` counts bias-correction steps
    per row instead of per table."""
    return RowOptimizer(name="lazy_adam", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, per_row_steps=per_row_steps)
