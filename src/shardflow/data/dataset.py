"""The Dataset and iterator contracts every source and transformation implements, and tf.data's chainable methods."""

from __future__ import annotations

import abc
import contextvars
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.element_spec import first_element_spec
from shardflow.data.errors import OutOfRangeError
from shardflow.data.optional import Optional

if TYPE_CHECKING:
    from shardflow.data.options import Options
    from shardflow.data.torch_iterable import TorchIterable

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

    def get_next(self) -> T:
        """The next element, as tf.data's `iterator.get_next()`: OutOfRangeError (not StopIteration) at the end."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> Optional[T]:
        """The next element wrapped in an Optional, which is empty at the end of the data."""
        try:
            return Optional.from_value(next(self))
        except StopIteration:
            return Optional.empty()

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
    are bytes). Transformations return new datasets; iterating starts a fresh pass.

    Every source and transformation accepts tf.data's `name=` keyword, which names the op for tf.data's debugging
    tools; shardflow accepts and ignores it."""

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

    def _cardinality(self) -> int:
        """This dataset's count from its definition alone, by tf.data's rule for it: a source or transformation
        with a rule overrides this default, which does not know."""
        return UNKNOWN_CARDINALITY

    def _element_spec(self) -> Any | None:
        """This dataset's spec from its definition alone: a source or transformation that defines its spec
        overrides this default, which leaves it to be read off the first element."""
        return None

    def cardinality(self) -> int:
        """The number of elements, INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2), by tf.data's rules."""
        return self._cardinality()

    def __len__(self) -> int:
        """`cardinality()`, with TypeError for an infinite or unknown count, as tf.data's `len()`."""
        count = self.cardinality()
        if count >= 0:
            return count
        infinite = count == INFINITE_CARDINALITY
        raise TypeError("The dataset is infinite." if infinite else "The dataset length is unknown.")

    def __bool__(self) -> bool:
        # Without this, `if dataset:` would call __len__, which raises for infinite and unknown counts.
        return True

    @property
    def element_spec(self) -> Any:
        """The structure of TensorSpecs of the elements: the static spec if the pipeline defines one, else the spec
        of its first element, which starts a pass (see element_spec.py)."""
        spec = self._element_spec()
        return first_element_spec(self) if spec is None else spec

    # Sources.

    @staticmethod
    def range(*args: int, output_type: Any = np.int64, name: str | None = None) -> Dataset[Any]:
        """range(stop), range(start, stop) or range(start, stop, step) of `output_type` (int64) scalars."""
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources.in_memory import RangeDataset

        return RangeDataset(*args, output_type=output_type)

    @staticmethod
    def from_tensors(element: Any, name: str | None = None) -> Dataset[Any]:
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources.in_memory import TensorsDataset

        return TensorsDataset(element)

    @staticmethod
    def from_tensor_slices(element: Any, name: str | None = None) -> Dataset[Any]:
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources.in_memory import TensorSlicesDataset

        return TensorSlicesDataset(element)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple[Any, ...] | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset[Any]:
        """`output_signature` (a structure of TensorSpecs), or its older form `output_types` with `output_shapes`,
        converts and checks each element; without either, elements are taken as they come."""
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources.generator import GeneratorDataset

        return GeneratorDataset(generator, output_signature, args, output_types, output_shapes)

    @staticmethod
    def list_files(
        file_pattern: str | list[str], shuffle: bool | None = None, seed: int | None = None, name: str | None = None
    ) -> Dataset[Any]:
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sources.list_files import ListFilesDataset

        return ListFilesDataset(file_pattern, shuffle=shuffle, seed=seed)

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset[Any]:
        """zip(a, b) or zip((a, b)) or zip({"x": a, "y": b}): elements shaped like the argument."""
        # Here, not at the top: the source subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.zip import ZipDataset

        return ZipDataset(datasets[0] if len(datasets) == 1 else datasets)

    @staticmethod
    def sample_from_datasets(
        datasets: list[Dataset[Any]],
        weights: Any = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset[Any]:
        """Each element from one of `datasets`, drawn with `weights` (a list, or a dataset of weight vectors)."""
        # Here, not at the top: sampling subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sampling import DirectedDataset, check_datasets

        return DirectedDataset(
            check_datasets(datasets, "sample_from_datasets"),
            stop_on_empty_dataset,
            weights=weights,
            seed=seed,
            rerandomize_each_iteration=rerandomize_each_iteration,
        )

    @staticmethod
    def choose_from_datasets(
        datasets: list[Dataset[Any]], choice_dataset: Dataset[Any], stop_on_empty_dataset: bool = True
    ) -> Dataset[Any]:
        """Each element from the dataset that the next int64 of `choice_dataset` names."""
        # Here, not at the top: sampling subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sampling import DirectedDataset, check_datasets

        if not isinstance(choice_dataset, Dataset):
            raise TypeError(
                f"choose_from_datasets choice_dataset must be a Dataset, got {type(choice_dataset).__name__}"
            )
        return DirectedDataset(
            check_datasets(datasets, "choose_from_datasets"), stop_on_empty_dataset, choice_dataset=choice_dataset
        )

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: Any = "int64", name: str | None = None) -> Dataset[Any]:
        """start, start + step, ... without end."""
        # Here, not at the top: counter subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.counter import CounterDataset

        return CounterDataset(start, step, dtype)

    @staticmethod
    def random(
        seed: int | None = None, rerandomize_each_iteration: bool | None = None, name: str | None = None
    ) -> Dataset[Any]:
        """Endless int64 scalars uniform in [0, 2**32), as tf.data's; the stream itself differs from TensorFlow's."""
        # Here, not at the top: counter subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.counter import RandomDataset

        return RandomDataset(seed, rerandomize_each_iteration)

    @staticmethod
    def load(
        path: str, element_spec: Any = None, compression: str | None = None, reader_func: Any = None
    ) -> Dataset[Any]:
        """A dataset written by `save` (shardflow's own format, see saved_format.py). The records carry their
        structure and dtypes, so `element_spec` is accepted for tf.data compatibility and not needed."""
        # Here, not at the top: snapshot subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.snapshot import LoadDataset

        return LoadDataset(path, compression, reader_func)

    # Transformations.

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        *,
        use_processes: bool = False,
        name: str | None = None,
    ) -> Dataset[Any]:
        """`use_processes=True` runs a Python-heavy `map_func` in forked worker processes (see processes.py)."""
        # Here, not at the top: mapping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.mapping import MapDataset

        return MapDataset(self, map_func, num_parallel_calls, deterministic, use_processes=use_processes)

    def flat_map(self, map_func: Callable[..., Dataset[Any]], name: str | None = None) -> Dataset[Any]:
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
        name: str | None = None,
    ) -> Dataset[Any]:
        # Here, not at the top: interleave subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.interleave import InterleaveDataset

        return InterleaveDataset(self, map_func, cycle_length, block_length, num_parallel_calls, deterministic)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset[T]:
        # Here, not at the top: mapping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.mapping import FilterDataset

        return FilterDataset(self, predicate)

    def shuffle(
        self,
        buffer_size: int,
        seed: int | None = None,
        reshuffle_each_iteration: bool = True,
        name: str | None = None,
    ) -> Dataset[T]:
        # Here, not at the top: shuffle subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.shuffle import ShuffleDataset

        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset[Any]:
        """Stacks elements; `num_parallel_calls` and `deterministic` are accepted for tf.data compatibility."""
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import BatchDataset

        return BatchDataset(self, batch_size, drop_remainder)

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import PaddedBatchDataset

        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values, drop_remainder)

    def unbatch(self, name: str | None = None) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import UnbatchDataset

        return UnbatchDataset(self)

    def rebatch(
        self, batch_size: int | list[int], drop_remainder: bool = False, name: str | None = None
    ) -> Dataset[Any]:
        # Here, not at the top: batching subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.batching import RebatchDataset

        return RebatchDataset(self, batch_size, drop_remainder)

    def window(
        self,
        size: int,
        shift: int | None = None,
        stride: int = 1,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset[Any]:
        """A dataset of windows; each window is the element structure with a Dataset at every leaf."""
        # Here, not at the top: window subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.window import WindowDataset

        return WindowDataset(self, size, shift, stride, drop_remainder)

    def cache(self, filename: str = "", name: str | None = None) -> Dataset[T]:
        # Here, not at the top: cache subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.cache import CacheDataset

        return CacheDataset(self, filename)

    def repeat(self, count: int | None = None, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import RepeatDataset

        return RepeatDataset(self, count)

    def take(self, count: int, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import TakeDataset

        return TakeDataset(self, count)

    def skip(self, count: int, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import SkipDataset

        return SkipDataset(self, count)

    def shard(self, num_shards: int, index: int, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import ShardDataset

        return ShardDataset(self, num_shards, index)

    def concatenate(self, dataset: Dataset[Any], name: str | None = None) -> Dataset[Any]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import ConcatenateDataset

        return ConcatenateDataset(self, dataset)

    def enumerate(self, start: int = 0, name: str | None = None) -> Dataset[Any]:
        # Here, not at the top: slicing subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.slicing import EnumerateDataset

        return EnumerateDataset(self, start)

    def group_by_window(
        self,
        key_func: Callable[..., Any],
        reduce_func: Callable[[Any, Dataset[Any]], Dataset[Any]],
        window_size: int | None = None,
        window_size_func: Callable[[Any], Any] | None = None,
        name: str | None = None,
    ) -> Dataset[Any]:
        # Here, not at the top: grouping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.grouping import GroupByWindowDataset

        return GroupByWindowDataset(self, key_func, reduce_func, window_size, window_size_func)

    def bucket_by_sequence_length(
        self,
        element_length_func: Callable[..., Any],
        bucket_boundaries: list[int],
        bucket_batch_sizes: list[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        no_padding: bool = False,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset[Any]:
        # Here, not at the top: grouping subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.grouping import bucket_by_sequence_length

        return bucket_by_sequence_length(
            self,
            element_length_func,
            bucket_boundaries,
            bucket_batch_sizes,
            padded_shapes,
            padding_values,
            pad_to_bucket_boundary,
            no_padding,
            drop_remainder,
        )

    def scan(self, initial_state: Any, scan_func: Callable[[Any, Any], Any], name: str | None = None) -> Dataset[Any]:
        """`scan_func(state, element)` returns (new state, output element)."""
        # Here, not at the top: scan subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.scan import ScanDataset

        return ScanDataset(self, initial_state, scan_func)

    def unique(self, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: unique subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.unique import UniqueDataset

        return UniqueDataset(self)

    def take_while(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset[T]:
        # Here, not at the top: take_while subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.take_while import TakeWhileDataset

        return TakeWhileDataset(self, predicate)

    def rejection_resample(
        self,
        class_func: Callable[..., Any],
        target_dist: Any,
        initial_dist: Any = None,
        seed: int | None = None,
        name: str | None = None,
    ) -> Dataset[Any]:
        """(class, element) pairs whose classes follow `target_dist`."""
        # Here, not at the top: resample subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.resample import RejectionResampleDataset

        return RejectionResampleDataset(self, class_func, target_dist, initial_dist, seed)

    def sparse_batch(self, batch_size: int, row_shape: Any, name: str | None = None) -> Dataset[Any]:
        """Batches of elements of different shapes as SparseTensors of dense shape [batch, *row_shape]."""
        # Here, not at the top: sparse_batch subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.sparse_batch import SparseBatchDataset

        return SparseBatchDataset(self, batch_size, row_shape)

    def snapshot(
        self,
        path: str,
        compression: str | None = "AUTO",
        reader_func: Any = None,
        shard_func: Any = None,
        name: str | None = None,
    ) -> Dataset[T]:
        """The first complete pass is saved under `path` (keyed by this pipeline's fingerprint); later passes,
        in this process or another, read it back."""
        # Here, not at the top: snapshot subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.snapshot import SnapshotDataset

        return SnapshotDataset(self, path, compression, reader_func, shard_func)

    def prefetch(self, buffer_size: int, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: prefetch subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.prefetch import PrefetchDataset

        return PrefetchDataset(self, buffer_size)

    def apply(self, transformation_func: Callable[[Dataset[T]], Dataset[Any]]) -> Dataset[Any]:
        return transformation_func(self)

    def ignore_errors(self, log_warning: bool = False, name: str | None = None) -> Dataset[T]:
        """Skips elements whose production raised; the iterator counts them in `num_skipped` and its state."""
        # Here, not at the top: ignore_errors subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.ignore_errors import IgnoreErrorsDataset

        return IgnoreErrorsDataset(self, log_warning)

    def with_options(self, options: Options, name: str | None = None) -> Dataset[T]:
        # Here, not at the top: options subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.options import OptionsDataset

        return OptionsDataset(self, options)

    # Consumers: they iterate the dataset and return a value.

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any], name: str | None = None) -> Any:
        """The state after `reduce_func(state, element)` over every element."""
        # Here, not at the top: reduction imports this module.
        from shardflow.data.reduction import reduce

        return reduce(self, initial_state, reduce_func)

    def get_single_element(self, name: str | None = None) -> T:
        """The only element; an error if there are none or more."""
        # Here, not at the top: reduction imports this module.
        from shardflow.data.reduction import get_single_element

        return get_single_element(self)

    def save(
        self, path: str, compression: str | None = None, shard_func: Any = None, checkpoint_args: Any = None
    ) -> None:
        """Writes every element under the directory `path` in shardflow's own format (see saved_format.py)."""
        # Here, not at the top: snapshot subclasses Dataset, so importing it above would be a cycle.
        from shardflow.data.snapshot import save

        save(self, path, compression, shard_func, checkpoint_args)

    def fingerprint(self) -> Any:
        """A uint64 equal for pipelines built the same way from the same sources and functions."""
        # Here, not at the top: fingerprint imports this module.
        from shardflow.data.fingerprint import fingerprint

        return fingerprint(self)

    def as_numpy_iterator(self) -> DatasetIterator[Any]:
        """Elements are already numpy; as in tf.data, sparse tensors come out dense and datasets of datasets raise."""
        # Here, not at the top: as_numpy subclasses this module's iterator, so importing it above would be a cycle.
        from shardflow.data.as_numpy import NumpyIterator

        return NumpyIterator(iter(self))

    def as_torch(self, device: Any = None, pin_memory: bool = False) -> TorchIterable:
        """This pipeline handed to torch: a torch IterableDataset whose elements have their numeric arrays as torch
        tensors (bytes stay numpy), copied ahead to `device` if given. In a DataLoader each worker process reads its
        own share (see TorchIterable)."""
        # Here, not at the top: torch_iterable imports this module (a cycle), and torch is imported only from here.
        from shardflow.data.torch_iterable import TorchIterable

        return TorchIterable(self, device, pin_memory)


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


def iter_epoch(dataset: Dataset[T], epoch: int) -> DatasetIterator[T]:
    """`iter(dataset)` as pass number `epoch`, as a repeat starts its passes: shuffles below reshuffle by the epoch
    rather than by how often this copy of the dataset was iterated."""
    token = _EPOCHS.set((*current_epochs(), epoch))
    try:
        return iter(dataset)
    finally:
        _EPOCHS.reset(token)


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
