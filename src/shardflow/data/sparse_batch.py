"""sparse_batch(batch_size, row_shape): elements of different shapes batched into one SparseTensor each."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardflow.data.batching import BatchDataset
from shardflow.data.dataset import Dataset
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.sparse import SparseTensor


class SparseBatchDataset(BatchDataset):
    """Each batch is a SparseTensor of dense shape [number of elements, *row_shape] holding the elements' values at
    their positions, row by row in row-major order. An element may be smaller than `row_shape`, never larger, and
    must have its rank."""

    def __init__(self, input_dataset: Dataset[Any], batch_size: int, row_shape: Any) -> None:
        super().__init__(input_dataset, batch_size, drop_remainder=False)
        shape = np.asarray(row_shape, dtype=np.int64).reshape(-1)
        if np.any(shape < 0):
            raise ValueError(f"sparse_batch row_shape must have non-negative dimensions, got {shape.tolist()}")
        self._row_shape = shape

    def _combine(self, elements: list[Any]) -> Any:
        rank = len(self._row_shape)
        indices: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for row, element in enumerate(elements):
            if isinstance(element, tuple | dict):
                raise TypeError("sparse_batch needs elements with a single component, not a tuple or dict")
            array = np.asarray(element, dtype=object) if isinstance(element, bytes) else np.asarray(element)
            if array.ndim != rank:
                raise ValueError(f"sparse_batch: element {row} has rank {array.ndim}, row_shape has rank {rank}")
            if np.any(np.asarray(array.shape) > self._row_shape):
                raise InvalidArgumentError(
                    f"sparse_batch: element {row} has shape {list(array.shape)}, larger than row_shape "
                    f"{self._row_shape.tolist()}"
                )
            positions = np.indices(array.shape).reshape(rank, array.size).T
            indices.append(np.column_stack([np.full(len(positions), row, dtype=np.int64), positions]))
            values.append(array.reshape(-1))
        return SparseTensor(
            indices=np.concatenate(indices).astype(np.int64, copy=False),
            values=np.concatenate(values),
            dense_shape=np.array([len(elements), *self._row_shape.tolist()], dtype=np.int64),
        )

    def _element_spec(self) -> None:
        return None  # a SparseTensor has no TensorSpec here
