"""shardflow.data.experimental: the names of tf.data.experimental that shardflow supports, so that code using them
ports by changing the import. Transformations return a function for `dataset.apply(...)`, as tf.data's do; most
are the Dataset method of the same name (docs/tfdata.md lists what is not supported, and why)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardflow._lazy import lazy_dir, lazy_getattr
from shardflow.data import structure
from shardflow.data.assert_cardinality import assert_cardinality
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator
from shardflow.data.optional import Optional
from shardflow.data.options import (
    AUTOTUNE,
    AutoShardPolicy,
    AutotuneAlgorithm,
    AutotuneOptions,
    DistributeOptions,
    ExternalStatePolicy,
    OptimizationOptions,
    ThreadingOptions,
)
from shardflow.data.sources.in_memory import ElementsDataset

if TYPE_CHECKING:
    from shardflow.data.dataset_writer import TFRecordWriter
    from shardflow.data.sources import CsvDataset, make_csv_dataset

Transformation = Callable[[Dataset[Any]], Dataset[Any]]

# File sources are imported on first use, as in shardflow.data.
_LAZY = {
    "CsvDataset": "shardflow.data.sources",
    "make_csv_dataset": "shardflow.data.sources",
    "TFRecordWriter": "shardflow.data.dataset_writer",
}
__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)


# Functions over datasets and iterators.


def cardinality(dataset: Dataset[Any]) -> int:
    return dataset.cardinality()


def get_single_element(dataset: Dataset[Any]) -> Any:
    return dataset.get_single_element()


def get_structure(dataset_or_iterator: Dataset[Any] | DatasetIterator[Any]) -> Any:
    """The element_spec of a dataset. shardflow's iterators do not keep their dataset, so unlike tf.data this
    takes datasets only."""
    if not isinstance(dataset_or_iterator, Dataset):
        raise TypeError(f"get_structure expects a shardflow.data.Dataset, got {type(dataset_or_iterator).__name__}")
    return dataset_or_iterator.element_spec


def get_next_as_optional(iterator: DatasetIterator[Any]) -> Optional[Any]:
    return iterator.get_next_as_optional()


def save(
    dataset: Dataset[Any],
    path: str,
    compression: str | None = None,
    shard_func: Any = None,
    checkpoint_args: Any = None,
) -> None:
    dataset.save(path, compression, shard_func, checkpoint_args)


def load(path: str, element_spec: Any = None, compression: str | None = None, reader_func: Any = None) -> Dataset[Any]:
    return Dataset.load(path, element_spec, compression, reader_func)


# Sources.


# Counter and RandomDataset are functions with class-like names in tf.data too.


def Counter(start: int = 0, step: int = 1, dtype: Any = "int64", name: str | None = None) -> Dataset[Any]:
    return Dataset.counter(start, step, dtype)


def RandomDataset(seed: int | None = None, name: str | None = None) -> Dataset[Any]:
    return Dataset.random(seed)


def from_list(elements: Sequence[Any], name: str | None = None) -> Dataset[Any]:
    """One element per item of `elements`, each a structure of arrays like the others."""
    if not elements:
        raise ValueError("from_list needs at least one element")
    normalized = [structure.normalize(element) for element in elements]
    _, first = structure.flatten(normalized[0])
    for index, element in enumerate(normalized[1:], start=1):
        _, other = structure.flatten(element)
        if other != first:
            raise ValueError(
                f"from_list: element {index} has structure {structure.describe(other)}, "
                f"element 0 has {structure.describe(first)}"
            )
    return ElementsDataset(normalized)


def sample_from_datasets(
    datasets: Sequence[Dataset[Any]],
    weights: Any = None,
    seed: int | None = None,
    stop_on_empty_dataset: bool = False,
) -> Dataset[Any]:
    return Dataset.sample_from_datasets(list(datasets), weights, seed, stop_on_empty_dataset)


def choose_from_datasets(
    datasets: Sequence[Dataset[Any]], choice_dataset: Dataset[Any], stop_on_empty_dataset: bool = False
) -> Dataset[Any]:
    """As Dataset.choose_from_datasets, but by default it goes on past an empty input, as tf.data's experimental
    version does (the method stops there)."""
    return Dataset.choose_from_datasets(list(datasets), choice_dataset, stop_on_empty_dataset)


# Transformations for `dataset.apply(...)`.


def ignore_errors(log_warning: bool = False) -> Transformation:
    return lambda dataset: dataset.ignore_errors(log_warning)


def enumerate_dataset(start: int = 0) -> Transformation:
    return lambda dataset: dataset.enumerate(start)


def unbatch() -> Transformation:
    return lambda dataset: dataset.unbatch()


def unique() -> Transformation:
    return lambda dataset: dataset.unique()


def take_while(predicate: Callable[..., Any]) -> Transformation:
    return lambda dataset: dataset.take_while(predicate)


def scan(initial_state: Any, scan_func: Callable[[Any, Any], Any]) -> Transformation:
    return lambda dataset: dataset.scan(initial_state, scan_func)


def group_by_window(
    key_func: Callable[..., Any],
    reduce_func: Callable[[Any, Dataset[Any]], Dataset[Any]],
    window_size: int | None = None,
    window_size_func: Callable[[Any], Any] | None = None,
) -> Transformation:
    return lambda dataset: dataset.group_by_window(key_func, reduce_func, window_size, window_size_func)


def bucket_by_sequence_length(
    element_length_func: Callable[..., Any],
    bucket_boundaries: list[int],
    bucket_batch_sizes: list[int],
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    no_padding: bool = False,
    drop_remainder: bool = False,
) -> Transformation:
    return lambda dataset: dataset.bucket_by_sequence_length(
        element_length_func,
        bucket_boundaries,
        bucket_batch_sizes,
        padded_shapes,
        padding_values,
        pad_to_bucket_boundary,
        no_padding,
        drop_remainder,
    )


def rejection_resample(
    class_func: Callable[..., Any], target_dist: Any, initial_dist: Any = None, seed: int | None = None
) -> Transformation:
    return lambda dataset: dataset.rejection_resample(class_func, target_dist, initial_dist, seed)


def dense_to_sparse_batch(batch_size: int, row_shape: Any) -> Transformation:
    return lambda dataset: dataset.sparse_batch(batch_size, row_shape)


def snapshot(
    path: str, compression: str | None = "AUTO", reader_func: Any = None, shard_func: Any = None
) -> Transformation:
    return lambda dataset: dataset.snapshot(path, compression, reader_func, shard_func)


def map_and_batch(
    map_func: Callable[..., Any],
    batch_size: int,
    num_parallel_batches: int | None = None,
    drop_remainder: bool = False,
    num_parallel_calls: int | None = None,
) -> Transformation:
    """map then batch: tf.data fuses the two, which changes nothing in the elements."""
    if num_parallel_batches is not None and num_parallel_calls is not None:
        raise ValueError("map_and_batch takes num_parallel_batches or num_parallel_calls, not both")
    if num_parallel_batches is not None:
        num_parallel_calls = num_parallel_batches * batch_size
    return lambda dataset: dataset.map(map_func, num_parallel_calls).batch(batch_size, drop_remainder)


def shuffle_and_repeat(buffer_size: int, count: int | None = None, seed: int | None = None) -> Transformation:
    return lambda dataset: dataset.shuffle(buffer_size, seed).repeat(count)


def parallel_interleave(
    map_func: Callable[..., Dataset[Any]],
    cycle_length: int,
    block_length: int = 1,
    sloppy: bool | None = False,
    buffer_output_elements: int | None = None,
    prefetch_input_elements: int | None = None,
) -> Transformation:
    """interleave with one parallel call per open input; `sloppy` allows out-of-order elements. The two buffer
    sizes are tf.data tuning knobs that shardflow's interleave sizes itself."""
    return lambda dataset: dataset.interleave(
        map_func, cycle_length, block_length, num_parallel_calls=cycle_length, deterministic=not sloppy
    )


def parse_example_dataset(
    features: dict[str, Any], num_parallel_calls: int = 1, deterministic: bool | None = None
) -> Transformation:
    """Parses a dataset of batches (1-D arrays) of serialized tf.train.Example records into dicts of features."""
    # Here, not at the top: the Example codec brings protobuf, which a pipeline over memory does not need.
    from shardflow.data.example import parse_example

    return lambda dataset: dataset.map(
        lambda serialized: parse_example(serialized, features), num_parallel_calls, deterministic
    )


__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneAlgorithm",
    "AutotuneOptions",
    "Counter",
    "CsvDataset",
    "DistributeOptions",
    "ExternalStatePolicy",
    "OptimizationOptions",
    "Optional",
    "RandomDataset",
    "TFRecordWriter",
    "ThreadingOptions",
    "assert_cardinality",
    "bucket_by_sequence_length",
    "cardinality",
    "choose_from_datasets",
    "dense_to_sparse_batch",
    "enumerate_dataset",
    "from_list",
    "get_next_as_optional",
    "get_single_element",
    "get_structure",
    "group_by_window",
    "ignore_errors",
    "load",
    "make_csv_dataset",
    "map_and_batch",
    "parallel_interleave",
    "parse_example_dataset",
    "rejection_resample",
    "sample_from_datasets",
    "save",
    "scan",
    "shuffle_and_repeat",
    "snapshot",
    "take_while",
    "unbatch",
    "unique",
]
