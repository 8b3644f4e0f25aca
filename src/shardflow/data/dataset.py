"""The Dataset and iterator contracts every source and transformation implements, and tf.data's chainable methods."""

from __future__ import annotations

import abc
import contextvars
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from shardflow.data.options import Options
    from shardflow.data.torch_edge import TorchDataset

T = TypeVar("T")

State = dict[str, Any]
"""An iterator's position: small, JSON-serializable, made of positions and seeds, never buffered data."""

# The merged options of the pipeline being iterated, seen by every iterator built inside the outermost `iter()`.
_ACTIVE_OPTIONS: contextvars.ContextVar[Options | None] = contextvars.ContextVar("shardflow_data_options", default=None)
# The epoch numbers of the enclosing repeats while they build a new pass, so that shuffles reshuffle per epoch.
_EPOCHS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("shardflow_data_epochs", default=None)


class DatasetIterator(abc.ABC, Iterator[T], Generic[T]):
    """One pass over a dataset. `get_state()` says where it is; `set_state()` on a fresh iterator of the
    same dataset continues with exactly the elements this one would have produced next."""

    def __iter__(self) -> DatasetIterator[T]:
        return self

    @abc.abstractmethod
    def __next__(self) -> T: ...

    @abc.abstractmethod
    def get_state(self) -> State: ...

    @abc.abstractmethod
    def set_state(self, state: State) -> None: ...

    def next_many(self, max_count: int) -> list[T]:
        """The next elements, as many `next()` calls would return them: at least one and at most `max_count`. It
        returns early before an element whose production raises, so that only a call that would return nothing
        raises (StopIteration at the end). Iterators that hold elements in lists override this to hand over a
        slice; this default returns one element, and `has_bulk_next` tells the two apart."""
        return [next(self)]

    def close(self) -> None:
        """Release threads, processes and files. Iterators without any keep this no-op."""

    @property
    def deterministic(self) -> bool:
        """Whether a restored iterator yields the remaining elements in the same order. Stages that restore by
        re-reading their input (prefetch replays, shuffle windows, unbatch) are exact only over deterministic
        input; prefetch falls back to a state per element when this is False."""
        return True


class Dataset(abc.ABC, Generic[T]):
    """An immutable description of a stream of elements (nested dicts and tuples of numpy arrays; strings
    are bytes). Transformations return new datasets; iterating starts a fresh pass."""

    @abc.abstractmethod
    def _iterator(self) -> DatasetIterator[T]: ...

    def __iter__(self) -> DatasetIterator[T]:
        if _ACTIVE_OPTIONS.get() is not None:
            return self._iterator()
        token = _ACTIVE_OPTIONS.set(self.options())
        try:
            return self._iterator()
        finally:
            _ACTIVE_OPTIONS.reset(token)

    # Pipeline introspection, used by `options()` and `auto_shard`. Sources keep the defaults.

    def _inputs(self) -> tuple[Dataset[Any], ...]:
        """The datasets this one reads from."""
        return ()

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[T]:
        """A copy of this dataset reading from `inputs` instead (same order as `_inputs()`)."""
        if inputs:
            raise NotImplementedError(f"{type(self).__name__} has no inputs to replace")
        return self

    def _shard_files(self, num_shards: int, index: int) -> Dataset[T] | None:
        """For a source that reads a list of files: the same source over its share of the files, for the FILE
        auto-shard policy. None (the default) means this dataset does not read files by name."""
        return None

    def options(self) -> Options:
        """The options of the whole pipeline up to here, later `with_options` calls winning."""
        # Here, not at the top: options subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.options import Options

        merged = Options()
        for dataset in self._inputs():
            merged = merged.merge(dataset.options())
        return merged

    # Sources.

    @staticmethod
    def range(*args: int) -> Dataset[Any]:
        """range(stop), range(start, stop) or range(start, stop, step) of int64 scalars."""
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import RangeDataset

        return RangeDataset(*args)

    @staticmethod
    def from_tensors(element: Any) -> Dataset[Any]:
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import TensorsDataset

        return TensorsDataset(element)

    @staticmethod
    def from_tensor_slices(element: Any) -> Dataset[Any]:
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import TensorSlicesDataset

        return TensorSlicesDataset(element)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any], output_signature: Any = None, args: tuple[Any, ...] | None = None
    ) -> Dataset[Any]:
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import GeneratorDataset

        return GeneratorDataset(generator, output_signature=output_signature, args=args)

    @staticmethod
    def list_files(file_pattern: str | list[str], shuffle: bool | None = None, seed: int | None = None) -> Dataset[Any]:
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import ListFilesDataset

        return ListFilesDataset(file_pattern, shuffle=shuffle, seed=seed)

    @staticmethod
    def zip(*datasets: Any) -> Dataset[Any]:
        """zip(a, b) or zip((a, b)) or zip({"x": a, "y": b}): elements shaped like the argument."""
        # Here, not at the top: sources_basic subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources_basic import ZipDataset

        return ZipDataset(datasets[0] if len(datasets) == 1 else datasets)

    # Transformations.

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        *,
        use_processes: bool = False,
    ) -> Dataset[Any]:
        """`use_processes=True` runs a Python-heavy `map_func` in forked worker processes (see processes.py)."""
        # Here, not at the top: mapping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.mapping import MapDataset

        return MapDataset(self, map_func, num_parallel_calls, deterministic, use_processes=use_processes)

    def flat_map(self, map_func: Callable[..., Dataset[Any]]) -> Dataset[Any]:
        # Here, not at the top: interleave subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.interleave import InterleaveDataset

        return InterleaveDataset(self, map_func, cycle_length=1, block_length=1)

    def interleave(
        self,
        map_func: Callable[..., Dataset[Any]],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset[Any]:
        # Here, not at the top: interleave subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.interleave import InterleaveDataset

        return InterleaveDataset(self, map_func, cycle_length, block_length, num_parallel_calls, deterministic)

    def filter(self, predicate: Callable[..., Any]) -> Dataset[T]:
        # Here, not at the top: mapping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.mapping import FilterDataset

        return FilterDataset(self, predicate)

    def shuffle(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True) -> Dataset[T]:
        # Here, not at the top: shuffle subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.shuffle import ShuffleDataset

        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset[Any]:
        """Stacks elements; `num_parallel_calls` and `deterministic` are accepted for tf.data compatibility."""
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import BatchDataset

        return BatchDataset(self, batch_size, drop_remainder)

    def padded_batch(
        self, batch_size: int, padded_shapes: Any = None, padding_values: Any = None, drop_remainder: bool = False
    ) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import PaddedBatchDataset

        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values, drop_remainder)

    def unbatch(self) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import UnbatchDataset

        return UnbatchDataset(self)

    def rebatch(self, batch_size: int | list[int], drop_remainder: bool = False) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import RebatchDataset

        return RebatchDataset(self, batch_size, drop_remainder)

    def window(
        self, size: int, shift: int | None = None, stride: int = 1, drop_remainder: bool = False
    ) -> Dataset[Any]:
        """A dataset of windows; each window is the element structure with a Dataset at every leaf."""
        # Here, not at the top: window subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.window import WindowDataset

        return WindowDataset(self, size, shift, stride, drop_remainder)

    def cache(self, filename: str = "") -> Dataset[T]:
        # Here, not at the top: cache subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.cache import CacheDataset

        return CacheDataset(self, filename)

    def repeat(self, count: int | None = None) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import RepeatDataset

        return RepeatDataset(self, count)

    def take(self, count: int) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import TakeDataset

        return TakeDataset(self, count)

    def skip(self, count: int) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import SkipDataset

        return SkipDataset(self, count)

    def shard(self, num_shards: int, index: int) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import ShardDataset

        return ShardDataset(self, num_shards, index)

    def concatenate(self, dataset: Dataset[Any]) -> Dataset[Any]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import ConcatenateDataset

        return ConcatenateDataset(self, dataset)

    def enumerate(self, start: int = 0) -> Dataset[Any]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import EnumerateDataset

        return EnumerateDataset(self, start)

    def prefetch(self, buffer_size: int) -> Dataset[T]:
        # Here, not at the top: prefetch subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.prefetch import PrefetchDataset

        return PrefetchDataset(self, buffer_size)

    def apply(self, transformation_func: Callable[[Dataset[T]], Dataset[Any]]) -> Dataset[Any]:
        return transformation_func(self)

    def ignore_errors(self, log_warning: bool = False) -> Dataset[T]:
        """Skips elements whose production raised; the iterator counts them in `num_skipped` and its state."""
        # Here, not at the top: errors subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.errors import IgnoreErrorsDataset

        return IgnoreErrorsDataset(self, log_warning)

    def with_options(self, options: Options) -> Dataset[T]:
        # Here, not at the top: options subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.options import OptionsDataset

        return OptionsDataset(self, options)

    def as_numpy_iterator(self) -> DatasetIterator[T]:
        """Elements are already numpy: kept so that tf.data code ports unchanged."""
        return iter(self)

    def as_torch(self, device: Any = None, pin_memory: bool = False) -> TorchDataset:
        """Elements with numeric arrays as torch tensors (bytes stay numpy), copied ahead to `device` if given."""
        # Here, not at the top: torch_edge subclasses Dataset (a cycle) and keeps torch's import off this path.
        from shardflow.data.torch_edge import TorchDataset

        return TorchDataset(self, device, pin_memory)


class UnaryDataset(Dataset[T]):
    """A transformation of one input dataset, stored as `_input`."""

    def __init__(self, input_dataset: Dataset[Any]) -> None:
        if not isinstance(input_dataset, Dataset):
            raise TypeError(f"expected a shardflow.data.Dataset as input, got {type(input_dataset).__name__}")
        self._input = input_dataset

    def _inputs(self) -> tuple[Dataset[Any], ...]:
        return (self._input,)

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[T]:
        clone = copy.copy(self)
        (clone._input,) = inputs
        return clone


class UnaryIterator(DatasetIterator[T]):
    """An iterator reading one input iterator, `_input`, which it closes with itself."""

    def __init__(self, input_iterator: DatasetIterator[Any]) -> None:
        self._input = input_iterator

    def close(self) -> None:
        self._input.close()

    @property
    def deterministic(self) -> bool:
        return self._input.deterministic


def has_bulk_next(iterator: DatasetIterator[Any]) -> bool:
    """Whether `iterator.next_many` returns more than one element per call (rather than the default one)."""
    return type(iterator).next_many is not DatasetIterator.next_many


def replay(iterator: DatasetIterator[Any], count: int) -> None:
    """Advances `iterator` by `count` elements, counting those whose production raised, to reach a position saved
    as (state, elements after it): cheaper than a state per element for the stages that run ahead."""
    bulk = has_bulk_next(iterator)
    while count > 0:
        try:
            if bulk:
                count -= len(iterator.next_many(count))
            else:
                next(iterator)
                count -= 1
        except StopIteration:
            return
        except Exception:
            count -= 1


def active_options() -> Options:
    """The options of the pipeline whose iterator is being built (defaults outside an `iter()` call)."""
    # Here, not at the top: options imports this module.
    from shardflow.data.options import Options

    return _ACTIVE_OPTIONS.get() or Options()


def current_epochs() -> tuple[int, ...]:
    """The epoch numbers of the enclosing repeats while they build an iterator (empty outside any repeat)."""
    return _EPOCHS.get() or ()


class IterationScope:
    """The options and enclosing epochs seen while an iterator is built, kept so that iterators it builds later
    (a repeat's next pass, an interleave's next input) see the same."""

    def __init__(self) -> None:
        self.options = active_options()
        self.epochs = current_epochs()

    def iter(self, dataset: Dataset[T], epoch: int | None = None) -> DatasetIterator[T]:
        """`iter(dataset)` in this scope, as pass number `epoch` of a repeat when given."""
        epochs = self.epochs if epoch is None else (*self.epochs, epoch)
        options_token = _ACTIVE_OPTIONS.set(self.options)
        epochs_token = _EPOCHS.set(epochs)
        try:
            return iter(dataset)
        finally:
            _EPOCHS.reset(epochs_token)
            _ACTIVE_OPTIONS.reset(options_token)
