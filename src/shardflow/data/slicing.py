"""Positional transformations: repeat, take, skip, shard, concatenate and enumerate."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from shardflow.data import structure
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import (
    Dataset,
    DatasetIterator,
    IterationScope,
    State,
    UnaryDataset,
    UnaryIterator,
)
from shardflow.data.element_spec import INT64, most_specific_compatible
from shardflow.data.errors import InvalidArgumentError

T = TypeVar("T")


def _count(value: Any, name: str) -> int:
    """A count where any negative value means "all" (-1 here), as in tf.data."""
    if not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int (negative for all), got {value!r}")
    return max(int(value), -1)


class RepeatDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], count: int | None) -> None:
        super().__init__(input_dataset)
        self._count = -1 if count is None else _count(count, "repeat count")

    def _iterator(self) -> DatasetIterator[T]:
        return _RepeatIterator(self._input, self._count)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if self._count < 0:
            # tf.data calls a repeat forever infinite even over an input of unknown count, which might be empty.
            return 0 if known == 0 else INFINITE_CARDINALITY
        if self._count == 0:
            return 0
        return known if known < 0 else known * self._count

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _RepeatIterator(DatasetIterator[T]):
    def __init__(self, dataset: Dataset[T], count: int) -> None:
        self._dataset = dataset
        self._count = count
        self._scope = IterationScope()
        self._epoch = 0
        self._input = self._scope.iter(dataset, 0) if count != 0 else None
        self._epoch_is_empty = True

    def __next__(self) -> T:
        while self._input is not None:
            try:
                element = next(self._input)
            except StopIteration:
                # A pass that produced nothing ends the repeat instead of looping forever, as in tf.data.
                done = self._epoch_is_empty or self._epoch + 1 == self._count
                self._start_epoch(None if done else self._epoch + 1)
                continue
            self._epoch_is_empty = False
            return element
        raise StopIteration

    def _start_epoch(self, epoch: int | None) -> None:
        if self._input is not None:
            self._input.close()
        self._input = None if epoch is None else self._scope.iter(self._dataset, epoch)
        self._epoch = self._count if epoch is None else epoch
        self._epoch_is_empty = True

    @property
    def deterministic(self) -> bool:
        return self._input is None or self._input.deterministic

    def get_state(self) -> State:
        return {"epoch": self._epoch, "input": None if self._input is None else self._input.get_state()}

    def set_state(self, state: State) -> None:
        self._start_epoch(None if state["input"] is None else int(state["epoch"]))
        if self._input is not None:
            self._input.set_state(state["input"])
            # A restored pass may be past its first element; it must not count as an empty pass.
            self._epoch_is_empty = False

    def close(self) -> None:
        if self._input is not None:
            self._input.close()


class TakeDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], count: int) -> None:
        super().__init__(input_dataset)
        self._count = _count(count, "take count")

    def _iterator(self) -> DatasetIterator[T]:
        return _TakeSkipIterator(iter(self._input), take=self._count, skip=0)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if known == UNKNOWN_CARDINALITY:
            return UNKNOWN_CARDINALITY  # even take(0): tf.data does not look at the count here
        if self._count < 0:
            return known
        return self._count if known == INFINITE_CARDINALITY else min(known, self._count)

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class SkipDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], count: int) -> None:
        super().__init__(input_dataset)
        self._count = _count(count, "skip count")

    def _iterator(self) -> DatasetIterator[T]:
        return _TakeSkipIterator(iter(self._input), take=-1, skip=self._count)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if known < 0:
            return known
        return 0 if self._count < 0 else max(0, known - self._count)

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _TakeSkipIterator(UnaryIterator[T]):
    """Skips `skip` elements (-1: all), then returns at most `take` (-1: all)."""

    def __init__(self, input_iterator: DatasetIterator[T], take: int, skip: int) -> None:
        super().__init__(input_iterator)
        self._take, self._skip = take, skip
        self._taken = 0
        self._skipped = 0

    def __next__(self) -> T:
        while self._skip == -1 or self._skipped < self._skip:
            next(self._input)
            self._skipped += 1
        if self._take != -1 and self._taken >= self._take:
            raise StopIteration
        element: T = next(self._input)
        self._taken += 1
        return element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "skipped": self._skipped, "taken": self._taken}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._skipped, self._taken = int(state["skipped"]), int(state["taken"])


class ShardDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], num_shards: int, index: int) -> None:
        super().__init__(input_dataset)
        if not isinstance(num_shards, int | np.integer) or num_shards < 1:
            raise InvalidArgumentError(f"shard num_shards must be a positive int, got {num_shards!r}")
        if not isinstance(index, int | np.integer) or not 0 <= index < num_shards:
            raise InvalidArgumentError(f"shard index must be in [0, num_shards={num_shards}), got {index!r}")
        self._num_shards, self._index = int(num_shards), int(index)

    def _iterator(self) -> DatasetIterator[T]:
        return _ShardIterator(iter(self._input), self._num_shards, self._index)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if known < 0:
            return known
        return known // self._num_shards + (1 if self._index < known % self._num_shards else 0)

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _ShardIterator(UnaryIterator[T]):
    """Elements index, index + num_shards, ...: skips up to the next one of this shard on each call."""

    def __init__(self, input_iterator: DatasetIterator[T], num_shards: int, index: int) -> None:
        super().__init__(input_iterator)
        self._num_shards = num_shards
        self._to_skip = index

    def __next__(self) -> T:
        while self._to_skip:
            next(self._input)
            self._to_skip -= 1
        self._to_skip = self._num_shards - 1
        element: T = next(self._input)
        return element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "to_skip": self._to_skip}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._to_skip = int(state["to_skip"])


class ConcatenateDataset(Dataset[Any]):
    def __init__(self, first: Dataset[Any], second: Dataset[Any]) -> None:
        if not isinstance(second, Dataset):
            raise TypeError(f"concatenate expects a shardflow.data.Dataset, got {type(second).__name__}")
        _check_static_types(first, second)
        self._datasets = (first, second)

    def _inputs(self) -> tuple[Dataset[Any], ...]:
        return self._datasets

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[Any]:
        return ConcatenateDataset(*inputs)

    def _iterator(self) -> DatasetIterator[Any]:
        return _ConcatenateIterator(self._datasets)

    def _cardinality(self) -> int:
        counts = [dataset._cardinality() for dataset in self._datasets]
        if INFINITE_CARDINALITY in counts:
            return INFINITE_CARDINALITY
        return UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in counts else sum(counts)

    def _element_spec(self) -> Any | None:
        first, second = (dataset._element_spec() for dataset in self._datasets)
        if first is None or second is None:
            return None
        first_leaves, first_tree = structure.flatten(first)
        second_leaves, second_tree = structure.flatten(second)
        if first_tree != second_tree or any(
            one.dtype != other.dtype for one, other in zip(first_leaves, second_leaves, strict=True)
        ):
            return None
        leaves = [most_specific_compatible(one, other) for one, other in zip(first_leaves, second_leaves, strict=True)]
        return structure.pack(first_tree, leaves)


def _check_static_types(first: Dataset[Any], second: Dataset[Any]) -> None:
    """TypeError now, as tf.data raises, where both inputs define their element spec; the iterator checks the
    others on their first elements."""
    first_spec, second_spec = first._element_spec(), second._element_spec()
    if first_spec is None or second_spec is None:
        return
    first_leaves, treedef = structure.flatten(first_spec)
    try:
        second_leaves = structure.flatten_as(treedef, second_spec, "concatenate")
    except TypeError:
        second_leaves = []
    if len(second_leaves) != len(first_leaves) or any(
        one.dtype != other.dtype for one, other in zip(first_leaves, second_leaves, strict=True)
    ):
        raise TypeError(f"concatenate: incompatible dataset elements, {first_spec} vs. {second_spec}")


class _ConcatenateIterator(DatasetIterator[Any]):
    """The second input's elements must have the first's structure and dtypes (TypeError otherwise, as in tf.data);
    this is checked on the first element of each, and dicts of the second are packed in the first's key order."""

    def __init__(self, datasets: tuple[Dataset[Any], Dataset[Any]]) -> None:
        self._datasets = datasets
        self._scope = IterationScope()
        self._which = 0
        self._input: DatasetIterator[Any] = iter(datasets[0])
        self._first_signature: structure.Signature | None = None
        self._unchecked = True  # whether the second input's next element is its first
        self._repack_as: structure.TreeDef | None = None

    def __next__(self) -> Any:
        if self._which == 0:
            try:
                element = next(self._input)
            except StopIteration:
                self._switch(1)
            else:
                if self._first_signature is None:
                    self._first_signature = structure.signature(element)
                return element
        element = next(self._input)
        if self._unchecked:
            self._unchecked = False
            self._check_second(element)
        if self._repack_as is not None:
            element = structure.pack(self._repack_as, structure.flatten_as(self._repack_as, element, "concatenate"))
        return element

    def _check_second(self, element: Any) -> None:
        if self._first_signature is None:
            return
        first_treedef, first_dtypes = self._first_signature
        treedef, dtypes = structure.signature(element)
        if treedef != first_treedef:
            # A TypeError if the structures differ other than in the order of dict keys.
            leaves = structure.flatten_as(first_treedef, element, "concatenate")
            dtypes = structure.signature(structure.pack(first_treedef, leaves))[1]
            self._repack_as = first_treedef
        if dtypes != first_dtypes:
            raise TypeError(
                f"concatenate: incompatible dataset elements, dtypes {[str(dtype) for dtype in first_dtypes]} "
                f"vs. {[str(dtype) for dtype in dtypes]} (structure {structure.describe(first_treedef)})"
            )

    def _switch(self, which: int) -> None:
        if which != self._which:
            self._input.close()
            self._input = self._scope.iter(self._datasets[which])
            self._which = which

    @property
    def deterministic(self) -> bool:
        return self._input.deterministic

    def get_state(self) -> State:
        return {"which": self._which, "input": self._input.get_state()}

    def set_state(self, state: State) -> None:
        self._switch(int(state["which"]))
        self._input.set_state(state["input"])

    def close(self) -> None:
        self._input.close()


class EnumerateDataset(UnaryDataset[tuple[np.int64, Any]]):
    def __init__(self, input_dataset: Dataset[Any], start: int) -> None:
        super().__init__(input_dataset)
        self._start = int(start)

    def _iterator(self) -> DatasetIterator[tuple[np.int64, Any]]:
        return _EnumerateIterator(iter(self._input), self._start)

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _element_spec(self) -> Any | None:
        spec = self._input._element_spec()
        return None if spec is None else (INT64, spec)


class _EnumerateIterator(UnaryIterator[tuple[np.int64, Any]]):
    def __init__(self, input_iterator: DatasetIterator[Any], start: int) -> None:
        super().__init__(input_iterator)
        self._next_index = start

    def __next__(self) -> tuple[np.int64, Any]:
        # The count advances before the input is asked, so an element that raises uses up its index (tf.data's
        # enumerate is a zip with a range).
        self._next_index += 1
        return np.int64(self._next_index - 1), next(self._input)

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "next_index": self._next_index}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._next_index = int(state["next_index"])
