"""The Dataset contract every source and transformation implements, and tf.data's chainable methods. The iterator
contract is in iteration.py and tf.data's static constructors in constructors.py; this module re-exports the first,
so that an op imports both contracts from here."""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.constructors import DatasetConstructors
from shardflow.data.element_spec import first_element_spec
from shardflow.data.iteration import (
    DatasetIterator,
    IterationScope,
    State,
    UnaryIterator,
    active_options,
    current_epochs,
    has_bulk_next,
    iter_epoch,
    replay,
    start_pass,
)

if TYPE_CHECKING:
    from shardflow.data.options import Options
    from shardflow.data.torch_iterable import TorchIterable

__all__ = [
    "Dataset",
    "DatasetIterator",
    "IterationScope",
    "State",
    "UnaryDataset",
    "UnaryIterator",
    "active_options",
    "current_epochs",
    "has_bulk_next",
    "iter_epoch",
    "replay",
]

T = TypeVar("T")


class Dataset(DatasetConstructors, abc.ABC, Generic[T]):
    """An immutable description of a stream of elements (nested dicts and tuples of numpy arrays; strings
    are bytes). Transformations return new datasets; iterating starts a fresh pass.

    Every source and transformation accepts tf.data's `name=` keyword, which names the op for tf.data's debugging
    tools; shardflow accepts and ignores it."""

    @abc.abstractmethod
    def _iterator(self) -> DatasetIterator[T]: ...

    def __iter__(self) -> DatasetIterator[T]:
        return start_pass(self)

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

    # Transformations. Each imports its op's module when called: the ops subclass Dataset, so importing them above
    # would be a cycle. The static constructors (range, from_tensor_slices, ...) are in constructors.py.

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
        from shardflow.data.mapping import MapDataset

        return MapDataset(self, map_func, num_parallel_calls, deterministic, use_processes=use_processes)

    def flat_map(self, map_func: Callable[..., Dataset[Any]], name: str | None = None) -> Dataset[Any]:
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
        from shardflow.data.interleave import InterleaveDataset

        return InterleaveDataset(self, map_func, cycle_length, block_length, num_parallel_calls, deterministic)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset[T]:
        from shardflow.data.mapping import FilterDataset

        return FilterDataset(self, predicate)

    def shuffle(
        self,
        buffer_size: int,
        seed: int | None = None,
        reshuffle_each_iteration: bool = True,
        name: str | None = None,
    ) -> Dataset[T]:
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
        from shardflow.data.batching import PaddedBatchDataset

        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values, drop_remainder)

    def unbatch(self, name: str | None = None) -> Dataset[Any]:
        from shardflow.data.batching import UnbatchDataset

        return UnbatchDataset(self)

    def rebatch(
        self, batch_size: int | list[int], drop_remainder: bool = False, name: str | None = None
    ) -> Dataset[Any]:
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
        from shardflow.data.window import WindowDataset

        return WindowDataset(self, size, shift, stride, drop_remainder)

    def cache(self, filename: str = "", name: str | None = None) -> Dataset[T]:
        from shardflow.data.cache import CacheDataset

        return CacheDataset(self, filename)

    def repeat(self, count: int | None = None, name: str | None = None) -> Dataset[T]:
        from shardflow.data.slicing import RepeatDataset

        return RepeatDataset(self, count)

    def take(self, count: int, name: str | None = None) -> Dataset[T]:
        from shardflow.data.slicing import TakeDataset

        return TakeDataset(self, count)

    def skip(self, count: int, name: str | None = None) -> Dataset[T]:
        from shardflow.data.slicing import SkipDataset

        return SkipDataset(self, count)

    def shard(self, num_shards: int, index: int, name: str | None = None) -> Dataset[T]:
        from shardflow.data.slicing import ShardDataset

        return ShardDataset(self, num_shards, index)

    def concatenate(self, dataset: Dataset[Any], name: str | None = None) -> Dataset[Any]:
        from shardflow.data.slicing import ConcatenateDataset

        return ConcatenateDataset(self, dataset)

    def enumerate(self, start: int = 0, name: str | None = None) -> Dataset[Any]:
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
        from shardflow.data.scan import ScanDataset

        return ScanDataset(self, initial_state, scan_func)

    def unique(self, name: str | None = None) -> Dataset[T]:
        from shardflow.data.unique import UniqueDataset

        return UniqueDataset(self)

    def take_while(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset[T]:
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
        from shardflow.data.resample import RejectionResampleDataset

        return RejectionResampleDataset(self, class_func, target_dist, initial_dist, seed)

    def sparse_batch(self, batch_size: int, row_shape: Any, name: str | None = None) -> Dataset[Any]:
        """Batches of elements of different shapes as SparseTensors of dense shape [batch, *row_shape]."""
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
        from shardflow.data.snapshot import SnapshotDataset

        return SnapshotDataset(self, path, compression, reader_func, shard_func)

    def prefetch(self, buffer_size: int, name: str | None = None) -> Dataset[T]:
        from shardflow.data.prefetch import PrefetchDataset

        return PrefetchDataset(self, buffer_size)

    def apply(self, transformation_func: Callable[[Dataset[T]], Dataset[Any]]) -> Dataset[Any]:
        return transformation_func(self)

    def ignore_errors(self, log_warning: bool = False, name: str | None = None) -> Dataset[T]:
        """Skips elements whose production raised; the iterator counts them in `num_skipped` and its state."""
        from shardflow.data.ignore_errors import IgnoreErrorsDataset

        return IgnoreErrorsDataset(self, log_warning)

    def with_options(self, options: Options, name: str | None = None) -> Dataset[T]:
        from shardflow.data.options import OptionsDataset

        return OptionsDataset(self, options)

    # Consumers: they iterate the dataset and return a value. Their modules, imported when called, import this one.

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any], name: str | None = None) -> Any:
        """The state after `reduce_func(state, element)` over every element."""
        from shardflow.data.reduction import reduce

        return reduce(self, initial_state, reduce_func)

    def get_single_element(self, name: str | None = None) -> T:
        """The only element; an error if there are none or more."""
        from shardflow.data.reduction import get_single_element

        return get_single_element(self)

    def save(
        self, path: str, compression: str | None = None, shard_func: Any = None, checkpoint_args: Any = None
    ) -> None:
        """Writes every element under the directory `path` in shardflow's own format (see saved_format.py)."""
        from shardflow.data.snapshot import save

        save(self, path, compression, shard_func, checkpoint_args)

    def fingerprint(self) -> Any:
        """A uint64 equal for pipelines built the same way from the same sources and functions."""
        from shardflow.data.fingerprint import fingerprint

        return fingerprint(self)

    def as_numpy_iterator(self) -> DatasetIterator[Any]:
        """Elements are already numpy; as in tf.data, sparse tensors come out dense and datasets of datasets raise."""
        from shardflow.data.as_numpy import NumpyIterator

        return NumpyIterator(iter(self))

    def as_torch(self, device: Any = None, pin_memory: bool = False) -> TorchIterable:
        """This pipeline handed to torch: a torch IterableDataset whose elements have their numeric arrays as torch
        tensors (bytes stay numpy), copied ahead to `device` if given. In a DataLoader each worker process reads its
        own share (see TorchIterable)."""
        # Imported here also because it imports torch, which a pipeline that never meets torch does not need.
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
