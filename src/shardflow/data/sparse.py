"""SparseTensor, the leaf a VarLenFeature parses into, and how a batch of them is stacked (as tf.data batches
tf.SparseTensor: one more leading dimension, the batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """tf.SparseTensor's fields as numpy arrays: `values[i]` sits at `indices[i]` in a tensor of `dense_shape`."""

    indices: npt.NDArray[np.int64]  # (number of values, rank)
    values: npt.NDArray[Any]
    dense_shape: npt.NDArray[np.int64]  # (rank,)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.values.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(size) for size in self.dense_shape)

    def __getitem__(self, row: int) -> SparseTensor:
        """Row `row` of the first dimension, one rank less (as unbatch splits a batch of sparse tensors)."""
        size = int(self.dense_shape[0])
        if not -size <= row < size:
            raise IndexError(f"row {row} is out of range for a SparseTensor of shape {list(self.shape)}")
        keep = self.indices[:, 0] == row % size
        return SparseTensor(self.indices[keep, 1:], self.values[keep], self.dense_shape[1:].copy())

    def numpy(self) -> npt.NDArray[Any]:
        """The dense array, zeros (b"" for strings) where no value is given, as tf.SparseTensor.numpy()."""
        dense = np.zeros(self.shape, dtype=self.values.dtype)
        if self.values.dtype == object:
            dense[...] = b""
        dense[tuple(self.indices.T)] = self.values
        return dense


def stack_sparse(tensors: list[SparseTensor], path: str = "") -> SparseTensor:
    """One SparseTensor for a batch: each tensor's indices behind its position in the batch, and a dense shape
    that is the largest of each dimension."""
    ranks = {len(tensor.dense_shape) for tensor in tensors}
    if len(ranks) > 1:
        raise ValueError(f"batch: sparse component {path or 'of the element'} has different ranks {sorted(ranks)}")
    rank = ranks.pop()
    counts = np.array([len(tensor.values) for tensor in tensors], dtype=np.int64)
    positions = np.repeat(np.arange(len(tensors), dtype=np.int64), counts)
    indices = np.concatenate([tensor.indices.reshape(-1, rank) for tensor in tensors])
    largest = np.max(np.stack([tensor.dense_shape for tensor in tensors]), axis=0)
    return SparseTensor(
        indices=np.concatenate([positions[:, None], indices.astype(np.int64, copy=False)], axis=1),
        values=np.concatenate([tensor.values for tensor in tensors]),
        dense_shape=np.concatenate([[len(tensors)], largest]).astype(np.int64),
    )
