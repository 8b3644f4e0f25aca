"""batch, padded_batch, unbatch and rebatch: elements stacked along a new first dimension, and split again."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator, has_bulk_next
from shardflow.data.element_spec import TensorSpec, map_leaves, resized
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.sparse import SparseTensor, stack_sparse


def _positive(value: Any, argument: str) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{argument} must be a positive int, got {value!r}")
    return int(value)


def group_leaves(elements: list[Any], operation: str) -> tuple[list[list[Any]], structure.TreeDef]:
    """The leaves of every element, grouped by position, checking that all elements share one structure."""
    first, treedef = structure.flatten(elements[0])
    columns = [[leaf] for leaf in first]
    for index, element in enumerate(elements[1:], start=1):
        leaves, other = structure.flatten(element)
        if other != treedef:
            try:
                leaves = structure.flatten_as(treedef, element, operation)
            except TypeError:
                raise ValueError(
                    f"{operation}: element {index} has structure {structure.describe(other)}, "
                    f"element 0 has {structure.describe(treedef)}"
                ) from None
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    return columns, treedef


def _object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def stack(elements: list[Any]) -> Any:
    """One batch from equally shaped elements; bytes leaves become object arrays of bytes."""
    if not structure.is_structure(elements[0]):
        return _stack_column(elements, "")
    columns, treedef = group_leaves(elements, "batch")
    paths = structure.leaf_paths(treedef)
    return structure.pack(treedef, [_stack_column(column, path) for column, path in zip(columns, paths, strict=True)])


def _stack_column(column: list[Any], path: str) -> np.ndarray | SparseTensor:
    first = column[0]
    if isinstance(first, bytes):
        return _object_array(column)
    if isinstance(first, SparseTensor):
        return stack_sparse(column, path)
    if isinstance(first, np.generic) and all(type(leaf) is type(first) for leaf in column):
        return np.array(column, dtype=first.dtype)  # several times faster than np.stack for scalars
    try:
        return np.stack(column)
    except ValueError:
        shapes = sorted({np.shape(leaf) for leaf in column})
        raise InvalidArgumentError(
            f"batch: component {path or 'of the element'} has different shapes {shapes} within one batch; "
            "use padded_batch, or make the shapes equal in a map before batching"
        ) from None


class BatchDataset(UnaryDataset[Any]):
    def __init__(self, input_dataset: Dataset[Any], batch_size: int, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        self._batch_size = _positive(batch_size, "batch_size")
        self._drop_remainder = drop_remainder

    def _combine(self, elements: list[Any]) -> Any:
        return stack(elements)

    def _iterator(self) -> DatasetIterator[Any]:
        return _BatchIterator(iter(self._input), self)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if known < 0:
            return known
        return known // self._batch_size if self._drop_remainder else -(-known // self._batch_size)

    def _element_spec(self) -> Any | None:
        spec = self._row_spec()
        if spec is None:
            return None
        size = self._batch_size if self._drop_remainder else None
        return map_leaves(spec, lambda leaf: resized(leaf, None if leaf.shape is None else (size, *leaf.shape)))

    def _row_spec(self) -> Any | None:
        """The static spec of one element as it goes into a batch."""
        return self._input._element_spec()


class _BatchIterator(UnaryIterator[Any]):
    def __init__(self, input_iterator: DatasetIterator[Any], dataset: BatchDataset) -> None:
        super().__init__(input_iterator)
        self._dataset = dataset
        self._bulk = has_bulk_next(input_iterator)

    def __next__(self) -> Any:
        batch_size = self._dataset._batch_size
        elements: list[Any] = []
        # An input error ends the batch: it is raised and the elements gathered so far are dropped, as in tf.data.
        try:
            if self._bulk:
                while len(elements) < batch_size:
                    elements += self._input.next_many(batch_size - len(elements))
            else:
                for _ in range(batch_size):
                    elements.append(next(self._input))
        except StopIteration:
            pass
        if not elements or (self._dataset._drop_remainder and len(elements) < batch_size):
            raise StopIteration
        return self._dataset._combine(elements)

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)


class PaddedBatchDataset(BatchDataset):
    """Pads each component to `padded_shapes` (None or -1: the largest in the batch; unset: all dimensions)
    with `padding_values` (0, or b"" for bytes; one value stands for every component; each must have its
    component's dtype, as in tf.data, where a Python int is int32 and a float float32)."""

    def __init__(
        self,
        input_dataset: Dataset[Any],
        batch_size: int,
        padded_shapes: Any,
        padding_values: Any,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input_dataset, batch_size, drop_remainder)
        self._padded_shapes = padded_shapes
        self._padding_values = padding_values

    def _combine(self, elements: list[Any]) -> Any:
        columns, treedef = group_leaves(elements, "padded_batch")
        paths = structure.leaf_paths(treedef)
        shapes = [None] * len(columns)
        if self._padded_shapes is not None:
            shapes = structure.flatten_up_to(treedef, self._padded_shapes, "padded_batch padded_shapes")
        values = [None] * len(columns)
        if self._padding_values is not None:
            values = structure.flatten_up_to(treedef, self._padding_values, "padded_batch padding_values", True)
        padded = [_pad(*args) for args in zip(columns, shapes, values, paths, strict=True)]
        return structure.pack(treedef, padded)

    def _row_spec(self) -> Any | None:
        spec = super()._row_spec()
        if spec is None or self._padded_shapes is None:
            return spec
        leaves, treedef = structure.flatten(spec)
        wanted = structure.flatten_up_to(treedef, self._padded_shapes, "padded_batch padded_shapes")
        padded = [
            TensorSpec(shape=tuple(None if size in (None, -1) else int(size) for size in shape), dtype=leaf.dtype)
            for leaf, shape in zip(leaves, wanted, strict=True)
        ]
        return structure.pack(treedef, padded)


def _pad(column: list[Any], shape: Any, value: Any, path: str) -> np.ndarray:
    arrays = [np.asarray(leaf, dtype=object) if isinstance(leaf, bytes) else np.asarray(leaf) for leaf in column]
    component = f"component {path}" if path else "the element"
    ranks = {array.ndim for array in arrays}
    if len(ranks) > 1:
        raise ValueError(f"padded_batch: {component} has different ranks {sorted(ranks)} within one batch")
    rank = ranks.pop()
    wanted = [None] * rank if shape is None else [None if size in (None, -1) else int(size) for size in shape]
    if len(wanted) != rank:
        raise ValueError(f"padded_batch: padded_shapes for {component} has rank {len(wanted)}, the data has {rank}")
    largest = [max(array.shape[dim] for array in arrays) for dim in range(rank)]
    for dim, (want, got) in enumerate(zip(wanted, largest, strict=True)):
        if want is not None and got > want:
            raise ValueError(
                f"padded_batch: {component} has size {got} in dimension {dim}, more than padded_shapes allows ({want})"
            )
    target = [got if want is None else want for want, got in zip(wanted, largest, strict=True)]
    dtype = arrays[0].dtype
    value = _padding_value(value, dtype, component)
    out = np.full((len(arrays), *target), value, dtype=dtype)
    for index, array in enumerate(arrays):
        region: tuple[Any, ...] = (index, *(slice(0, size) for size in array.shape))
        out[region] = array
    return out


def _padding_value(value: Any, dtype: np.dtype[Any], component: str) -> Any:
    """The value to pad with: the given one, which must have the component's dtype once converted as tf.data
    converts it (a Python int is int32, a float float32, a str bytes), or 0 (b"" for strings)."""
    if value is None:
        return b"" if dtype.kind == "O" else 0
    converted = structure.to_numpy(value)
    if np.ndim(converted) != 0:
        raise ValueError(f"padded_batch: padding_values for {component} must be a scalar, got {value!r}")
    given = np.dtype(object) if isinstance(converted, bytes) else np.asarray(converted).dtype
    if given != dtype:
        raise TypeError(
            f"padded_batch: padding_values for {component} has dtype {_dtype_name(given)}, but the component has "
            f"{_dtype_name(dtype)}; give a value of that dtype"
        )
    return converted


def _dtype_name(dtype: np.dtype[Any]) -> str:
    return "bytes" if dtype.kind == "O" else dtype.name


def _split(batch: Any, operation: str) -> tuple[list[Any], structure.TreeDef, int]:
    leaves, treedef = structure.flatten(batch)
    shapes = [leaf.shape if isinstance(leaf, SparseTensor) else np.shape(leaf) for leaf in leaves]
    lengths = {shape[0] for shape in shapes if shape}
    if len(lengths) != 1 or not all(shapes):
        raise ValueError(f"{operation} needs components of rank >= 1 with one first dimension, got shapes {shapes}")
    return leaves, treedef, lengths.pop()


class UnbatchDataset(UnaryDataset[Any]):
    def _iterator(self) -> DatasetIterator[Any]:
        return _UnbatchIterator(iter(self._input))

    def _cardinality(self) -> int:
        # Only a batch dimension fixed in the input's static spec (from_tensors of an array, batch with
        # drop_remainder) tells how many rows each element holds.
        known = self._input._cardinality()
        spec = self._input._element_spec()
        if known < 0 or spec is None:
            return UNKNOWN_CARDINALITY if known != INFINITE_CARDINALITY else INFINITE_CARDINALITY
        leaves, _ = structure.flatten(spec)
        rows = {leaf.shape[0] if leaf.shape else None for leaf in leaves}
        (size,) = rows if len(rows) == 1 else (None,)
        return UNKNOWN_CARDINALITY if size is None else known * size

    def _element_spec(self) -> Any | None:
        spec = self._input._element_spec()
        if spec is None:
            return None
        leaves, _ = structure.flatten(spec)
        if any(leaf.shape is None or not leaf.shape for leaf in leaves):
            return None
        return map_leaves(spec, lambda leaf: resized(leaf, (leaf.shape or ())[1:]))


class _UnbatchIterator(UnaryIterator[Any]):
    """State: the input's state before the open batch and the position in it; a restore re-reads the batch."""

    _operation = "unbatch"

    def __init__(self, input_iterator: DatasetIterator[Any]) -> None:
        super().__init__(input_iterator)
        self._batch_start: State | None = None
        self._leaves: list[Any] = []
        self._treedef: structure.TreeDef = None
        self._length = 0
        self._position = 0

    def __next__(self) -> Any:
        while self._batch_start is None:
            self._open()
        element = structure.pack(self._treedef, [leaf[self._position] for leaf in self._leaves])
        self._position += 1
        if self._position == self._length:
            self._batch_start, self._leaves, self._position = None, [], 0
        return element

    def _open(self) -> None:
        start = self._input.get_state()
        self._leaves, self._treedef, self._length = _split(next(self._input), self._operation)
        if self._length:
            self._batch_start = start

    def get_state(self) -> State:
        start = self._input.get_state() if self._batch_start is None else self._batch_start
        return {"input": start, "position": self._position}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._batch_start, self._leaves, self._position = None, [], 0
        if state["position"]:
            self._open()
            self._position = int(state["position"])


class RebatchDataset(UnaryDataset[Any]):
    """Batches of `batch_size` rows cut from the input's batches (a list of sizes is cycled through)."""

    def __init__(self, input_dataset: Dataset[Any], batch_size: int | list[int], drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        sizes = list(batch_size) if isinstance(batch_size, list | tuple | np.ndarray) else [batch_size]
        if not sizes:
            raise ValueError("rebatch batch_size must be a positive int or a non-empty list of them")
        self._sizes = [_positive(size, "rebatch batch_size") for size in sizes]
        self._drop_remainder = drop_remainder

    def _iterator(self) -> DatasetIterator[Any]:
        return _RebatchIterator(iter(self._input), self._sizes, self._drop_remainder)

    def _element_spec(self) -> Any | None:
        spec = self._input._element_spec()
        if spec is None:
            return None
        return map_leaves(spec, lambda leaf: resized(leaf, None if leaf.shape is None else (None, *leaf.shape[1:])))


class _RebatchIterator(_UnbatchIterator):
    _operation = "rebatch"

    def __init__(self, input_iterator: DatasetIterator[Any], sizes: list[int], drop_remainder: bool) -> None:
        super().__init__(input_iterator)
        self._sizes = sizes
        self._drop_remainder = drop_remainder
        self._cycle = 0

    def __next__(self) -> Any:
        wanted = self._sizes[self._cycle]
        parts: list[list[Any]] = []
        treedef: structure.TreeDef = None
        rows = 0
        while rows < wanted:
            if self._batch_start is None:
                try:
                    self._open()
                except StopIteration:
                    break
                continue
            take = min(wanted - rows, self._length - self._position)
            parts.append([leaf[self._position : self._position + take] for leaf in self._leaves])
            treedef = self._treedef
            rows += take
            self._position += take
            if self._position == self._length:
                self._batch_start, self._leaves, self._position = None, [], 0
        if rows == 0 or (rows < wanted and self._drop_remainder):
            raise StopIteration
        self._cycle = (self._cycle + 1) % len(self._sizes)
        columns = [np.concatenate(column) if len(parts) > 1 else column[0] for column in zip(*parts, strict=True)]
        return structure.pack(treedef, columns)

    def get_state(self) -> State:
        return {**super().get_state(), "cycle": self._cycle}

    def set_state(self, state: State) -> None:
        super().set_state(state)
        self._cycle = int(state["cycle"])
