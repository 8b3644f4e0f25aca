"""as_numpy_iterator(): elements as tf.data's as_numpy_iterator gives them, sparse tensors made dense."""

from __future__ import annotations

from typing import Any

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryIterator
from shardflow.data.sparse import SparseTensor


class NumpyIterator(UnaryIterator[Any]):
    """The input's elements; a dataset of datasets raises TypeError, as in tf.data. An element's structure is
    the same throughout a dataset, so its first element tells whether any leaf needs converting."""

    def __init__(self, input_iterator: DatasetIterator[Any]) -> None:
        super().__init__(input_iterator)
        self._has_sparse: bool | None = None

    def __next__(self) -> Any:
        return self._convert(next(self._input))

    def next_many(self, max_count: int) -> list[Any]:
        elements = self._input.next_many(max_count)
        if self._has_sparse is False:
            return elements
        return [self._convert(element) for element in elements]

    def _convert(self, element: Any) -> Any:
        if self._has_sparse is False:
            return element
        leaves, treedef = structure.flatten(element)
        if self._has_sparse is None:
            for leaf in leaves:
                if isinstance(leaf, Dataset):
                    raise TypeError(
                        "as_numpy_iterator() does not support datasets whose elements are datasets (as window "
                        "makes); flat_map them into one dataset first"
                    )
            self._has_sparse = any(isinstance(leaf, SparseTensor) for leaf in leaves)
            if not self._has_sparse:
                return element
        return structure.pack(treedef, [leaf.numpy() if isinstance(leaf, SparseTensor) else leaf for leaf in leaves])

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)
