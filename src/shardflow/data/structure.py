"""Nested elements: dicts and tuples of numpy values, flattened to leaves and packed back as tf.nest does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardflow.data.sparse import SparseTensor

TreeDef = Any
"""None for a leaf; ("dict", keys, children) or ("tuple", type, children) for a structure. Dict keys keep their
insertion order, as tf.data's elements do."""

_INT32 = np.iinfo(np.int32)


def is_structure(value: Any) -> bool:
    # Lists are values, not structure, as in tf.data: from_tensor_slices([1, 2]) slices one array.
    return isinstance(value, dict | tuple)


def flatten(element: Any) -> tuple[list[Any], TreeDef]:
    """The leaves of `element` (dict values in key order) and the definition to pack them again."""
    leaves: list[Any] = []
    return leaves, _flatten_into(element, leaves)


def _flatten_into(element: Any, leaves: list[Any]) -> TreeDef:
    if isinstance(element, dict):
        return ("dict", tuple(element), tuple(_flatten_into(value, leaves) for value in element.values()))
    if isinstance(element, tuple):
        return ("tuple", type(element), tuple(_flatten_into(item, leaves) for item in element))
    leaves.append(element)
    return None


def pack(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    """The inverse of `flatten`."""
    return _pack_from(treedef, iter(leaves))


def _pack_from(treedef: TreeDef, leaves: Any) -> Any:
    if treedef is None:
        return next(leaves)
    kind, meta, children = treedef
    if kind == "dict":
        return {key: _pack_from(child, leaves) for key, child in zip(meta, children, strict=True)}
    items = [_pack_from(child, leaves) for child in children]
    return meta(*items) if hasattr(meta, "_fields") else meta(items)


def flatten_as(treedef: TreeDef, element: Any, operation: str) -> list[Any]:
    """The leaves of `element` in the order of `treedef`, which it must match up to the order of dict keys (tf.data
    packs every element into its dataset's one structure)."""
    leaves, actual = flatten(element)
    if actual == treedef:
        return leaves
    if _same_up_to_key_order(actual, treedef):
        return flatten_up_to(treedef, element, operation)
    raise TypeError(f"{operation}: element has structure {describe(actual)}, expected {describe(treedef)}")


def _same_up_to_key_order(one: TreeDef, other: TreeDef) -> bool:
    if one is None or other is None:
        return one is other
    if one[0] != other[0] or len(one[2]) != len(other[2]):
        return False
    if one[0] == "tuple":
        return one[1] is other[1] and all(map(_same_up_to_key_order, one[2], other[2]))
    children = dict(zip(other[1], other[2], strict=True))
    return set(one[1]) == set(children) and all(
        _same_up_to_key_order(child, children[key]) for key, child in zip(one[1], one[2], strict=True)
    )


Signature = tuple[TreeDef, tuple[Any, ...]]
"""An element's structure and the dtype of each leaf (np.dtype(object) for bytes, ("sparse", dtype) for sparse)."""


def signature(element: Any) -> Signature:
    leaves, treedef = flatten(element)
    return treedef, tuple(_leaf_dtype(leaf) for leaf in leaves)


def _leaf_dtype(leaf: Any) -> Any:
    if isinstance(leaf, bytes):
        return np.dtype(object)
    if isinstance(leaf, SparseTensor):
        return ("sparse", leaf.values.dtype)
    return np.asarray(leaf).dtype


def describe(treedef: TreeDef) -> str:
    """A short readable form of a structure for error messages: {'a': ., 'b': (., .)}."""
    if treedef is None:
        return "."
    kind, meta, children = treedef
    if kind == "dict":
        return "{" + ", ".join(f"{key!r}: {describe(child)}" for key, child in zip(meta, children, strict=True)) + "}"
    return "(" + ", ".join(describe(child) for child in children) + ("," if len(children) == 1 else "") + ")"


def to_numpy(value: Any) -> Any:
    """One leaf as shardflow keeps it: numpy arrays and scalars, bytes for strings, object arrays of bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, np.ndarray):
        return _strings_to_bytes(value) if value.dtype.kind in "US" else value
    if isinstance(value, np.generic):
        return value.item() if isinstance(value, np.bytes_) else value.encode() if isinstance(value, np.str_) else value
    if isinstance(value, bool | int | float):
        return _literal(value)
    if isinstance(value, SparseTensor):
        return value
    if value is None:
        raise TypeError("elements cannot contain None: use a numpy array, a number, or bytes")
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"cannot convert {type(value).__name__} to a numpy array of numbers or bytes: {value!r:.80}")
    if array.dtype.kind in "US":
        # From the items, not from `array`: numpy's fixed-width bytes drop trailing zero bytes (of a serialized
        # record, say), which tf.data keeps.
        array = _strings_to_bytes(np.array(value, dtype=object))
    elif array.dtype in (np.int64, np.float64) and isinstance(value, list) and _only_python_numbers(value):
        array = _narrow_literals(array)
    return array[()] if array.ndim == 0 else array


def _literal(value: bool | int | float) -> np.generic:
    """A Python number as tf.data converts it: bool, int32 (int64 when out of int32's range), float32."""
    if isinstance(value, bool):
        return np.bool_(value)
    if isinstance(value, int):
        return np.int32(value) if _INT32.min <= value <= _INT32.max else np.int64(value)
    return np.float32(value)


def _only_python_numbers(items: list[Any] | tuple[Any, ...]) -> bool:
    # numpy values in a list keep their dtype (np.float64 is a float subclass, hence the exact type test).
    return all(
        _only_python_numbers(item) if type(item) in (list, tuple) else type(item) in (int, float) for item in items
    )


def _narrow_literals(array: np.ndarray) -> np.ndarray:
    """A nested list of Python numbers converts to int32 (int64 when a value does not fit) or float32, as in TF."""
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        return array
    return array.astype(np.int32)


def _strings_to_bytes(array: np.ndarray) -> Any:
    """str and bytes items (of a str, bytes or object array) as an object array of bytes."""
    encode = _encode if array.dtype.kind in "UO" else bytes
    out = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        out[index] = encode(item)
    return out[()] if out.ndim == 0 else out


def _encode(item: Any) -> bytes:
    return item.encode() if isinstance(item, str) else bytes(item)


def normalize(element: Any) -> Any:
    """Converts every leaf of a user-given element with `to_numpy`, keeping dicts and tuples."""
    leaves, treedef = flatten(element)
    return pack(treedef, [to_numpy(leaf) for leaf in leaves])


def call_with_element(fn: Callable[..., Any], element: Any) -> Any:
    """Calls a user function as tf.data does: a tuple element is unpacked into positional arguments."""
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        return fn(*element)
    return fn(element)


def leaf_nbytes(element: Any) -> int:
    """Approximate memory held by an element, for buffer budgets."""
    leaves, _ = flatten(element)
    return sum(
        leaf.nbytes if isinstance(leaf, np.ndarray | np.generic) else len(leaf) if isinstance(leaf, bytes) else 8
        for leaf in leaves
    )


def flatten_up_to(treedef: TreeDef, value: Any, argument: str, broadcast: bool = False) -> list[Any]:
    """The parts of `value` at the leaves of `treedef` (a subtree of `value` counts as one part). With
    `broadcast`, a single value stands for every leaf below it. Used for padded_shapes and padding_values."""
    if treedef is None:
        return [value]
    kind, meta, children = treedef
    if not is_structure(value):
        if broadcast:
            return [value] * len(leaf_paths(treedef))
        raise ValueError(f"{argument} must have the element's structure {describe(treedef)}, got {value!r}")
    if kind == "dict":
        if not isinstance(value, dict) or value.keys() != set(meta):
            raise ValueError(f"{argument} must have the element's structure {describe(treedef)}, got {value!r}")
        parts = [value[key] for key in meta]
    else:
        if not isinstance(value, tuple) or len(value) != len(children):
            raise ValueError(f"{argument} must have the element's structure {describe(treedef)}, got {value!r}")
        parts = list(value)
    return [
        leaf
        for child, part in zip(children, parts, strict=True)
        for leaf in flatten_up_to(child, part, argument, broadcast)
    ]


def leaf_paths(treedef: TreeDef, prefix: str = "") -> list[str]:
    """Readable paths of the leaves, in flatten order: ["['image']", "['label']"], or [""] for a single leaf."""
    if treedef is None:
        return [prefix]
    kind, meta, children = treedef
    keys = meta if kind == "dict" else range(len(children))
    return [path for key, child in zip(keys, children, strict=True) for path in leaf_paths(child, f"{prefix}[{key!r}]")]
