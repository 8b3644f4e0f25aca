"""`Dataset.element_spec`: the structure of TensorSpecs (shape, dtype) of a pipeline's elements.

Each source and transformation gives its spec from its definition in its `_element_spec()`, as tf.data does, with
None for a dimension that varies (a batch without drop_remainder); this module holds TensorSpec and the helpers
those methods share. A function shardflow cannot trace (map, flat_map, interleave) or a source whose records it
cannot know without reading (Parquet, CSV) gives none, and the spec is then read off the first element of a fresh
pass, so every dimension is that element's size."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardflow.data import structure

if TYPE_CHECKING:
    from shardflow.data.dataset import Dataset


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The shape (None for any size) and numpy dtype of one leaf of a generator's `output_signature`.
    Use `bytes` (or object) as dtype for strings."""

    shape: tuple[int | None, ...] | list[int | None] | None
    """None accepts any shape; a None dimension accepts any size."""
    dtype: Any = np.float32
    """Leaves are converted to this dtype."""
    name: str | None = None
    """Accepted for tf.TensorSpec compatibility; unused."""


STRING = TensorSpec(shape=(), dtype=bytes)
"""The spec of a scalar string, the element of the file sources that yield records."""
INT64 = TensorSpec(shape=(), dtype=np.dtype(np.int64))
"""The spec of an int64 scalar, such as enumerate's count."""


def first_element_spec(dataset: Dataset[Any]) -> Any:
    """The spec of the first element of a fresh pass over `dataset`, for a pipeline without a static spec."""
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


def spec_of(element: Any) -> Any:
    """The spec of one element: each leaf's exact shape and dtype (bytes for strings)."""
    leaves, treedef = structure.flatten(element)
    return structure.pack(treedef, [_leaf_spec(leaf) for leaf in leaves])


def spec_or_none(element: Any) -> Any | None:
    """`spec_of(element)`, or None where a leaf has no TensorSpec (such as a SparseTensor)."""
    try:
        return spec_of(element)
    except TypeError:
        return None


def normalized(spec: TensorSpec) -> TensorSpec:
    """`spec` with its shape as a tuple (or None) and its dtype as a numpy dtype, or bytes for strings."""
    shape = None if spec.shape is None else tuple(None if size is None else int(size) for size in spec.shape)
    return TensorSpec(shape=shape, dtype=spec_dtype(spec.dtype), name=spec.name)


def spec_dtype(dtype: Any) -> Any:
    """`dtype` as a spec holds it: a numpy dtype, or bytes for strings."""
    if dtype in (bytes, str, object):
        return bytes
    numpy_dtype = np.dtype(dtype)
    return bytes if numpy_dtype.kind in "OSU" else numpy_dtype


def _leaf_spec(leaf: Any) -> TensorSpec:
    if isinstance(leaf, bytes):
        return STRING
    if isinstance(leaf, np.ndarray | np.generic):
        return TensorSpec(shape=tuple(np.shape(leaf)), dtype=spec_dtype(leaf.dtype))
    raise TypeError(f"element_spec: a leaf of type {type(leaf).__name__} has no TensorSpec")


def resized(spec: TensorSpec, shape: Sequence[int | None] | None) -> TensorSpec:
    """`spec` with `shape` (None: any shape) and the same dtype."""
    return TensorSpec(shape=None if shape is None else tuple(shape), dtype=spec.dtype)


def map_leaves(spec: Any, change: Callable[[TensorSpec], TensorSpec]) -> Any:
    """The structure `spec` with `change` applied to each of its TensorSpecs."""
    leaves, treedef = structure.flatten(spec)
    return structure.pack(treedef, [change(leaf) for leaf in leaves])


def most_specific_compatible(first: TensorSpec, second: TensorSpec) -> TensorSpec:
    """The spec that both `first` and `second` satisfy: the dimensions they agree on, None where they differ."""
    if first.shape is None or second.shape is None or len(first.shape) != len(second.shape):
        return TensorSpec(shape=None, dtype=first.dtype)
    shape = tuple(mine if mine == theirs else None for mine, theirs in zip(first.shape, second.shape, strict=True))
    return TensorSpec(shape=shape, dtype=first.dtype)
