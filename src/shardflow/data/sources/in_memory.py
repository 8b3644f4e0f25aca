"""Sources over arrays already in memory: range, from_tensors, from_tensor_slices, and a list of elements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.element_spec import TensorSpec, spec_dtype, spec_or_none
from shardflow.data.errors import InvalidArgumentError


class RangeDataset(Dataset[np.generic]):
    def __init__(self, *args: int, output_type: Any = np.int64) -> None:
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes (stop), (start, stop) or (start, stop, step), got {len(args)} arguments")
        if len(args) == 3 and args[2] == 0:
            raise InvalidArgumentError("range step must not be 0")
        self._range = range(*(int(arg) for arg in args))
        self._output_type = np.dtype(output_type).type
        if not issubclass(self._output_type, np.integer | np.floating):
            raise TypeError(f"range output_type must be an integer or float dtype, got {output_type!r}")

    def _iterator(self) -> DatasetIterator[np.generic]:
        return _IndexIterator(len(self._range), self._element_at, self._elements_between)

    def _cardinality(self) -> int:
        return len(self._range)

    def _element_spec(self) -> TensorSpec:
        return TensorSpec(shape=(), dtype=np.dtype(self._output_type))

    def _element_at(self, index: int) -> np.generic:
        value: np.generic = self._output_type(self._range[index])
        return value

    def _elements_between(self, start: int, end: int) -> list[np.generic]:
        # One arange for the whole slice: several times faster than converting each int.
        part = self._range[start:end]
        return list(np.arange(part.start, part.stop, part.step, dtype=np.int64).astype(self._output_type, copy=False))


class ElementsDataset(Dataset[Any]):
    """A dataset over a list of already-normalized elements."""

    def __init__(self, elements: Sequence[Any]) -> None:
        self._elements = elements

    def _iterator(self) -> DatasetIterator[Any]:
        return _IndexIterator(len(self._elements), self._elements.__getitem__)

    def _cardinality(self) -> int:
        return len(self._elements)


class _IndexIterator(DatasetIterator[Any]):
    def __init__(
        self,
        length: int,
        element_at: Callable[[int], Any],
        elements_between: Callable[[int, int], list[Any]] | None = None,
    ) -> None:
        self._length = length
        self._element_at = element_at
        self._elements_between = elements_between or (lambda start, end: list(map(element_at, range(start, end))))
        self._index = 0

    def __next__(self) -> Any:
        if self._index >= self._length:
            raise StopIteration
        self._index += 1
        return self._element_at(self._index - 1)

    def next_many(self, max_count: int) -> list[Any]:
        start = self._index
        if start >= self._length:
            raise StopIteration
        self._index = min(start + max_count, self._length)
        return self._elements_between(start, self._index)

    def get_state(self) -> State:
        return {"index": self._index}

    def set_state(self, state: State) -> None:
        self._index = int(state["index"])


class TensorsDataset(ElementsDataset):
    def __init__(self, element: Any) -> None:
        super().__init__([structure.normalize(element)])

    def _element_spec(self) -> Any | None:
        return spec_or_none(self._elements[0])


class TensorSlicesDataset(Dataset[Any]):
    """Slices every leaf along its first dimension; all leaves must have the same first dimension."""

    def __init__(self, element: Any) -> None:
        leaves, self._treedef = structure.flatten(structure.normalize(element))
        if not leaves:
            raise ValueError("from_tensor_slices needs at least one array")
        for leaf in leaves:
            if not isinstance(leaf, np.ndarray) or leaf.ndim == 0:
                raise ValueError(f"from_tensor_slices needs arrays of rank >= 1 to slice, got a scalar {leaf!r:.40}")
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) > 1:
            shapes = ", ".join(str(leaf.shape) for leaf in leaves)
            raise ValueError(f"from_tensor_slices needs equal first dimensions, got shapes {shapes}")
        self._leaves = leaves
        self._length = lengths.pop()

    def _element_at(self, index: int) -> Any:
        return structure.pack(self._treedef, [leaf[index] for leaf in self._leaves])

    def _elements_between(self, start: int, end: int) -> list[Any]:
        # Iterating an array yields what indexing it would (rows, or numpy scalars), without a call per element.
        if self._treedef is None:
            return list(self._leaves[0][start:end])
        rows = zip(*(leaf[start:end] for leaf in self._leaves), strict=True)
        return [structure.pack(self._treedef, row) for row in rows]

    def _iterator(self) -> DatasetIterator[Any]:
        return _IndexIterator(self._length, self._element_at, self._elements_between)

    def _cardinality(self) -> int:
        return self._length

    def _element_spec(self) -> Any:
        leaves = [TensorSpec(shape=tuple(leaf.shape[1:]), dtype=spec_dtype(leaf.dtype)) for leaf in self._leaves]
        return structure.pack(self._treedef, leaves)
