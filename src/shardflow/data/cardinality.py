"""How many elements a pipeline yields, computed from its definition without iterating, by tf.data's rules; and
assert_cardinality, which states the count where those rules cannot know it."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeVar

from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.errors import FailedPreconditionError

T = TypeVar("T")

INFINITE_CARDINALITY = -1
"""The count of a dataset that never ends (`repeat()`, `counter()`)."""
UNKNOWN_CARDINALITY = -2
"""The count of a dataset whose size depends on the data (`filter`, `flat_map`, file sources)."""

_INFINITE, _UNKNOWN = INFINITE_CARDINALITY, UNKNOWN_CARDINALITY

Rule = Callable[[Any], int]
_RULES: dict[type, Rule] = {}
_builtin_rules_registered = False


def cardinality(dataset: Dataset[Any]) -> int:
    """The number of elements, INFINITE_CARDINALITY or UNKNOWN_CARDINALITY: for each transformation, tf.data's
    rule applied to its inputs' counts. A dataset type without a rule has an unknown count."""
    if not _builtin_rules_registered:
        _register_builtin_rules()
    for cls in type(dataset).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule(dataset)
    return _UNKNOWN


def _input_count(dataset: Dataset[Any]) -> int:
    (source,) = dataset._inputs()
    return cardinality(source)


def _unknown(dataset: Dataset[Any]) -> int:
    return _UNKNOWN


def _infinite(dataset: Dataset[Any]) -> int:
    return _INFINITE


def _directed(dataset: Dataset[Any]) -> int:
    """sample_from_datasets and choose_from_datasets: infinite if an input is, whatever the choices or
    stop_on_empty_dataset say (tf.data's rule), else unknown."""
    return _INFINITE if _INFINITE in (cardinality(source) for source in dataset._inputs()) else _UNKNOWN


def _repeat(dataset: Any) -> int:
    count, known = int(dataset._count), _input_count(dataset)
    if count < 0:
        # tf.data calls a repeat forever infinite even over an input of unknown count, which might be empty.
        return 0 if known == 0 else _INFINITE
    if count == 0:
        return 0
    return known if known < 0 else known * count


def _take(dataset: Any) -> int:
    count, known = int(dataset._count), _input_count(dataset)
    if known == _UNKNOWN:
        return _UNKNOWN  # even take(0): tf.data does not look at the count here
    if count < 0:
        return known
    return count if known == _INFINITE else min(known, count)


def _skip(dataset: Any) -> int:
    count, known = int(dataset._count), _input_count(dataset)
    if known < 0:
        return known
    return 0 if count < 0 else max(0, known - count)


def _shard(dataset: Any) -> int:
    known = _input_count(dataset)
    if known < 0:
        return known
    num_shards: int = dataset._num_shards
    return known // num_shards + (1 if dataset._index < known % num_shards else 0)


def _batch(dataset: Any) -> int:
    known = _input_count(dataset)
    if known < 0:
        return known
    size: int = dataset._batch_size
    return known // size if dataset._drop_remainder else -(-known // size)


def _unbatch(dataset: Any) -> int:
    # Only a batch dimension fixed in the input's static spec (from_tensors of an array, batch with
    # drop_remainder) tells how many rows each element holds.
    # Here, not at the top: element_spec imports the op modules, which import this one's callers.
    from shardflow.data.element_spec import static_spec
    from shardflow.data.structure import flatten

    known = _input_count(dataset)
    spec = static_spec(dataset._input)
    if known < 0 or spec is None:
        return _UNKNOWN if known != _INFINITE else _INFINITE
    leaves, _ = flatten(spec)
    rows = {leaf.shape[0] if leaf.shape else None for leaf in leaves}
    (size,) = rows if len(rows) == 1 else (None,)
    return _UNKNOWN if size is None else known * size


def _window(dataset: Any) -> int:
    known = _input_count(dataset)
    if known < 0:
        return known
    size, shift, stride = int(dataset._size), int(dataset._shift), int(dataset._stride)
    if not dataset._drop_remainder:
        return -(-known // shift)
    last_start = known - 1 - (size - 1) * stride
    return last_start // shift + 1 if last_start >= 0 else 0


def _concatenate(dataset: Dataset[Any]) -> int:
    counts = [cardinality(source) for source in dataset._inputs()]
    if _INFINITE in counts:
        return _INFINITE
    return _UNKNOWN if _UNKNOWN in counts else sum(counts)


def _zip(dataset: Dataset[Any]) -> int:
    counts = [cardinality(source) for source in dataset._inputs()]
    if _UNKNOWN in counts:
        return _UNKNOWN
    finite = [count for count in counts if count != _INFINITE]
    return min(finite) if finite else _INFINITE


def register(cls: type, rule: Rule) -> None:
    """Make `rule(dataset)` the cardinality of datasets of type `cls` (and its subclasses without their own)."""
    _RULES[cls] = rule


def _register_builtin_rules() -> None:
    # Here, not at the top: these modules subclass Dataset and some import this one. torch_edge is left out: it
    # imports torch, which a pipeline that never meets torch does not need.
    from shardflow.data import (
        batching,
        cache,
        counter,
        ignore_errors,
        interleave,
        mapping,
        options,
        prefetch,
        sampling,
        scan,
        shuffle,
        slicing,
        snapshot,
        sources_basic,
        window,
    )

    register(sources_basic.RangeDataset, lambda dataset: len(dataset._range))
    register(sources_basic.ElementsDataset, lambda dataset: len(dataset._elements))
    register(sources_basic.TensorSlicesDataset, lambda dataset: dataset._length)
    register(sources_basic.ListFilesDataset, lambda dataset: len(dataset._files))
    register(sources_basic.ZipDataset, _zip)
    for same in (
        mapping.MapDataset,
        shuffle.ShuffleDataset,
        prefetch.PrefetchDataset,
        cache.CacheDataset,
        options.OptionsDataset,
        slicing.EnumerateDataset,
        scan.ScanDataset,
        snapshot.SnapshotDataset,
    ):
        register(same, _input_count)
    register(counter.CounterDataset, _infinite)
    register(counter.RandomDataset, _infinite)
    register(sampling.DirectedDataset, _directed)
    for unknown in (mapping.FilterDataset, interleave.InterleaveDataset, ignore_errors.IgnoreErrorsDataset):
        register(unknown, _unknown)
    register(slicing.RepeatDataset, _repeat)
    register(slicing.TakeDataset, _take)
    register(slicing.SkipDataset, _skip)
    register(slicing.ShardDataset, _shard)
    register(slicing.ConcatenateDataset, _concatenate)
    register(batching.BatchDataset, _batch)
    register(batching.UnbatchDataset, _unbatch)
    register(batching.RebatchDataset, _unknown)
    register(window.WindowDataset, _window)
    register(AssertCardinalityDataset, lambda dataset: int(dataset._expected))
    global _builtin_rules_registered
    _builtin_rules_registered = True


class AssertCardinalityDataset(UnaryDataset[T]):
    """The input, declared to have `expected` elements: `cardinality()` returns it, and iteration raises
    FailedPreconditionError as soon as the input yields more, or ends with fewer."""

    def __init__(self, input_dataset: Dataset[T], expected: int) -> None:
        super().__init__(input_dataset)
        if not isinstance(expected, numbers.Integral) or isinstance(expected, bool) or expected < _INFINITE:
            raise ValueError(f"assert_cardinality expects a count >= 0 or INFINITE_CARDINALITY, got {expected!r}")
        self._expected: int = int(expected)

    def _iterator(self) -> DatasetIterator[T]:
        return _AssertCardinalityIterator(iter(self._input), self._expected)


class _AssertCardinalityIterator(UnaryIterator[T]):
    def __init__(self, input_iterator: DatasetIterator[T], expected: int) -> None:
        super().__init__(input_iterator)
        self._expected = expected
        self._num_seen = 0

    def __next__(self) -> T:
        try:
            element: T = next(self._input)
        except StopIteration:
            if self._expected != self._num_seen:
                raise FailedPreconditionError(
                    f"assert_cardinality: the input has {self._num_seen} elements, expected {_describe(self._expected)}"
                ) from None
            raise
        self._num_seen += 1
        if 0 <= self._expected < self._num_seen:
            raise FailedPreconditionError(
                f"assert_cardinality: the input has more than the {self._expected} elements expected"
            )
        return element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "num_seen": self._num_seen}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._num_seen = int(state["num_seen"])


def _describe(count: int) -> str:
    return {_INFINITE: "an infinite number", _UNKNOWN: "an unknown number"}.get(count, str(count))


def assert_cardinality(expected_cardinality: int) -> Callable[[Dataset[T]], Dataset[T]]:
    """For `dataset.apply(...)`, as tf.data.experimental.assert_cardinality."""
    return lambda dataset: AssertCardinalityDataset(dataset, expected_cardinality)
