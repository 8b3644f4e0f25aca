"""`Dataset.element_spec`: the structure of TensorSpecs (shape, dtype) of a pipeline's elements.

Sources and shape-preserving or batching transformations give it from their definition, as tf.data does, with
None for a dimension that varies (a batch without drop_remainder). A function shardflow cannot trace (map,
flat_map, interleave) or a source whose records it cannot know without reading (Parquet, CSV) gives none, and
the spec is then read off the first element of a fresh pass, so every dimension is that element's size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardflow.data import (
    batching,
    cache,
    cardinality,
    ignore_errors,
    mapping,
    options,
    prefetch,
    shuffle,
    slicing,
    sources_basic,
    sparse_batch,
    structure,
    window,
)
from shardflow.data.dataset import Dataset
from shardflow.data.sources.fixed import FixedLengthRecordDataset
from shardflow.data.sources.text import TextLineDataset
from shardflow.data.sources.tfrecord import TFRecordDataset
from shardflow.data.sources_basic import TensorSpec

Rule = Callable[[Any], Any]
_RULES: dict[type, Rule] = {}

_STRING = TensorSpec(shape=(), dtype=bytes)


def element_spec(dataset: Dataset[Any]) -> Any:
    """The static spec if the pipeline defines one, else the spec of its first element (which starts a pass)."""
    spec = static_spec(dataset)
    if spec is not None:
        return spec
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(
            f"element_spec: {type(dataset).__name__} has no static spec and yields no element to read one from"
        ) from None
    finally:
        iterator.close()
    return spec_of(first)


def static_spec(dataset: Dataset[Any]) -> Any | None:
    """The spec given by the pipeline's definition alone, or None where it depends on the data."""
    for cls in type(dataset).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule(dataset)
    return None


def spec_of(element: Any) -> Any:
    """The spec of one element: each leaf's exact shape and dtype (bytes for strings)."""
    leaves, treedef = structure.flatten(element)
    return structure.pack(treedef, [_leaf_spec(leaf) for leaf in leaves])


def _spec_or_none(element: Any) -> Any | None:
    try:
        return spec_of(element)
    except TypeError:
        return None  # a leaf without a TensorSpec, such as a SparseTensor


def _normalized(spec: TensorSpec) -> TensorSpec:
    """`spec` with its shape as a tuple (or None) and its dtype as a numpy dtype, or bytes for strings."""
    shape = None if spec.shape is None else tuple(None if size is None else int(size) for size in spec.shape)
    return TensorSpec(shape=shape, dtype=_dtype(spec.dtype), name=spec.name)


def _dtype(dtype: Any) -> Any:
    if dtype in (bytes, str, object):
        return bytes
    numpy_dtype = np.dtype(dtype)
    return bytes if numpy_dtype.kind in "OSU" else numpy_dtype


def _leaf_spec(leaf: Any) -> TensorSpec:
    if isinstance(leaf, bytes):
        return _STRING
    if isinstance(leaf, np.ndarray | np.generic):
        return TensorSpec(shape=tuple(np.shape(leaf)), dtype=_dtype(leaf.dtype))
    raise TypeError(f"element_spec: a leaf of type {type(leaf).__name__} has no TensorSpec")


def _resized(spec: TensorSpec, shape: Sequence[int | None] | None) -> TensorSpec:
    return TensorSpec(shape=None if shape is None else tuple(shape), dtype=spec.dtype)


def _map_leaves(spec: Any, change: Callable[[TensorSpec], TensorSpec]) -> Any:
    leaves, treedef = structure.flatten(spec)
    return structure.pack(treedef, [change(leaf) for leaf in leaves])


def _input_spec(dataset: Dataset[Any]) -> Any | None:
    (source,) = dataset._inputs()
    return static_spec(source)


def _batch(dataset: Any) -> Any | None:
    spec = _input_spec(dataset)
    if spec is None:
        return None
    if isinstance(dataset, batching.PaddedBatchDataset) and dataset._padded_shapes is not None:
        leaves, treedef = structure.flatten(spec)
        wanted = structure.flatten_up_to(treedef, dataset._padded_shapes, "padded_batch padded_shapes")
        spec = structure.pack(
            treedef,
            [
                TensorSpec(shape=tuple(None if size in (None, -1) else int(size) for size in shape), dtype=leaf.dtype)
                for leaf, shape in zip(leaves, wanted, strict=True)
            ],
        )
    size = dataset._batch_size if dataset._drop_remainder else None
    return _map_leaves(spec, lambda leaf: _resized(leaf, (size, *leaf.shape) if leaf.shape is not None else None))


def _unbatch(dataset: Any) -> Any | None:
    spec = _input_spec(dataset)
    if spec is None:
        return None
    leaves, _ = structure.flatten(spec)
    if any(leaf.shape is None or not leaf.shape for leaf in leaves):
        return None
    return _map_leaves(spec, lambda leaf: _resized(leaf, (leaf.shape or ())[1:]))


def _rebatch(dataset: Any) -> Any | None:
    spec = _input_spec(dataset)
    if spec is None:
        return None
    return _map_leaves(spec, lambda leaf: _resized(leaf, None if leaf.shape is None else (None, *leaf.shape[1:])))


def _most_specific_compatible(first: TensorSpec, second: TensorSpec) -> TensorSpec:
    if first.shape is None or second.shape is None or len(first.shape) != len(second.shape):
        return TensorSpec(shape=None, dtype=first.dtype)
    shape = tuple(mine if mine == theirs else None for mine, theirs in zip(first.shape, second.shape, strict=True))
    return TensorSpec(shape=shape, dtype=first.dtype)


def _concatenate(dataset: Dataset[Any]) -> Any | None:
    first, second = (static_spec(source) for source in dataset._inputs())
    if first is None or second is None:
        return None
    first_leaves, first_tree = structure.flatten(first)
    second_leaves, second_tree = structure.flatten(second)
    if first_tree != second_tree or any(a.dtype != b.dtype for a, b in zip(first_leaves, second_leaves, strict=True)):
        return None
    leaves = [_most_specific_compatible(a, b) for a, b in zip(first_leaves, second_leaves, strict=True)]
    return structure.pack(first_tree, leaves)


def _zip(dataset: Any) -> Any | None:
    specs = [static_spec(source) for source in dataset._inputs()]
    if any(spec is None for spec in specs):
        return None
    return structure.pack(dataset._treedef, specs)


def _enumerate(dataset: Dataset[Any]) -> Any | None:
    spec = _input_spec(dataset)
    return None if spec is None else (TensorSpec(shape=(), dtype=np.dtype(np.int64)), spec)


def _generator(dataset: Any) -> Any | None:
    if dataset._signature is None:
        return None
    specs, treedef = dataset._signature
    return structure.pack(treedef, [_normalized(spec) for spec in specs])


def _tensor_slices(dataset: Any) -> Any:
    leaves = [TensorSpec(shape=tuple(leaf.shape[1:]), dtype=_dtype(leaf.dtype)) for leaf in dataset._leaves]
    return structure.pack(dataset._treedef, leaves)


def register(cls: type, rule: Rule) -> None:
    """Make `rule(dataset)` the static spec of datasets of type `cls`; a rule returns None where it cannot tell."""
    _RULES[cls] = rule


register(sources_basic.RangeDataset, lambda dataset: TensorSpec(shape=(), dtype=np.dtype(dataset._output_type)))
register(sources_basic.TensorsDataset, lambda dataset: _spec_or_none(dataset._elements[0]))
register(sources_basic.TensorSlicesDataset, _tensor_slices)
register(sources_basic.GeneratorDataset, _generator)
register(sources_basic.ListFilesDataset, lambda dataset: _STRING)
register(sources_basic.ZipDataset, _zip)
for source in (TFRecordDataset, TextLineDataset, FixedLengthRecordDataset):
    register(source, lambda dataset: _STRING)
for same in (
    mapping.FilterDataset,
    shuffle.ShuffleDataset,
    prefetch.PrefetchDataset,
    cache.CacheDataset,
    options.OptionsDataset,
    slicing.RepeatDataset,
    slicing.TakeDataset,
    slicing.SkipDataset,
    slicing.ShardDataset,
    ignore_errors.IgnoreErrorsDataset,
    cardinality.AssertCardinalityDataset,
):
    register(same, _input_spec)
register(slicing.ConcatenateDataset, _concatenate)
register(slicing.EnumerateDataset, _enumerate)
register(batching.BatchDataset, _batch)
register(batching.UnbatchDataset, _unbatch)
register(batching.RebatchDataset, _rebatch)
# Their elements hold datasets (windows) or SparseTensors, which have no TensorSpec here.
register(window.WindowDataset, lambda dataset: None)
register(sparse_batch.SparseBatchDataset, lambda dataset: None)
