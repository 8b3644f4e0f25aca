"""Elements as a msgpack-able description plus raw buffers, so that processes and the file cache need no pickle."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.sparse import SparseTensor

_ALIGN = 64


def aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class Encoded:
    """One element: `spec` (msgpack-able: structure and per-leaf dtype, shape, size) and its raw `buffers`."""

    __slots__ = ("buffers", "nbytes", "spec")

    def __init__(self, spec: list[Any], buffers: list[memoryview]) -> None:
        self.spec = spec
        self.buffers = buffers
        self.nbytes = sum(aligned(buffer.nbytes) for buffer in buffers)


def encode(element: Any) -> Encoded:
    leaves, treedef = structure.flatten(element)
    leaf_specs: list[Any] = []
    buffers: list[memoryview] = []
    for leaf in leaves:
        if isinstance(leaf, bytes):
            leaf_specs.append(["b", len(leaf)])
            buffers.append(memoryview(leaf))
        elif isinstance(leaf, np.ndarray | np.generic):
            leaf_specs.append(_encode_array(leaf, buffers))
        elif isinstance(leaf, bool | int | float):
            leaf_specs.append(["p", leaf])
        elif isinstance(leaf, SparseTensor):
            parts = (leaf.indices, leaf.values, leaf.dense_shape)
            leaf_specs.append(["s", *(_encode_array(part, buffers) for part in parts)])
        else:
            raise TypeError(
                f"cannot send or cache a {type(leaf).__name__}: elements must hold numpy arrays, numbers or bytes"
            )
    return Encoded([_encode_tree(treedef), leaf_specs], buffers)


def _encode_array(leaf: np.ndarray | np.generic, buffers: list[memoryview]) -> list[Any]:
    array = np.asarray(leaf)
    if array.dtype == object:
        items = array.reshape(-1).tolist()
        if not all(isinstance(item, bytes) for item in items):
            raise TypeError("object arrays in elements must hold only bytes")
        lengths = np.fromiter((len(item) for item in items), dtype=np.int64, count=len(items))
        buffers.append(lengths.view(np.uint8).data)
        buffers.append(memoryview(b"".join(items)))
        return ["o", list(array.shape), lengths.nbytes, buffers[-1].nbytes]
    if array.dtype.fields is not None or array.dtype.kind == "V":
        raise TypeError(f"structured dtype {array.dtype} is not supported in elements; use one array per field")
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    buffers.append(raw.data)
    return ["a", array.dtype.str, list(array.shape), isinstance(leaf, np.generic), raw.nbytes]


def _encode_tree(treedef: structure.TreeDef) -> Any:
    if treedef is None:
        return 0
    kind, meta, children = treedef
    encoded_children = [_encode_tree(child) for child in children]
    if kind == "dict":
        return ["d", list(meta), encoded_children]
    if hasattr(meta, "_fields"):
        return ["n", meta.__module__, meta.__qualname__, encoded_children]
    return ["t", encoded_children]


def _decode_tree(encoded: Any) -> structure.TreeDef:
    if encoded == 0:
        return None
    if encoded[0] == "d":
        return ("dict", tuple(encoded[1]), tuple(_decode_tree(child) for child in encoded[2]))
    if encoded[0] == "n":
        return ("tuple", _namedtuple_type(encoded[1], encoded[2]), tuple(_decode_tree(child) for child in encoded[3]))
    return ("tuple", tuple, tuple(_decode_tree(child) for child in encoded[1]))


def _namedtuple_type(module: str, qualname: str) -> type:
    # Only looks the type up in modules already loaded (never imports), falling back to a plain tuple.
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, tuple) and hasattr(found, "_fields") else tuple


def write(encoded: Encoded, target: memoryview, offset: int) -> None:
    """Copies the buffers into `target` from `offset`, each aligned, as `decode` expects them."""
    for buffer in encoded.buffers:
        target[offset : offset + buffer.nbytes] = buffer
        offset += aligned(buffer.nbytes)


def decode(spec: Sequence[Any], source: memoryview, offset: int, copy: bool = True) -> Any:
    """The element `write` put at `offset` of `source` (only numpy arrays, bytes, numbers, sparse tensors and
    tuples are built):
    copied out so that `source` can be released, or with
    `copy=False` as views of a `source` that the caller hands over for good."""
    tree, leaf_specs = spec
    leaves = []
    for leaf_spec in leaf_specs:
        leaf, offset = _decode_leaf(leaf_spec, source, offset, copy)
        leaves.append(leaf)
    return structure.pack(_decode_tree(tree), leaves)


def _decode_leaf(leaf_spec: Sequence[Any], source: memoryview, offset: int, copy: bool) -> tuple[Any, int]:
    """One leaf, and the offset after its buffers."""
    kind = leaf_spec[0]
    if kind == "p":
        return leaf_spec[1], offset
    if kind == "b":
        return bytes(source[offset : offset + leaf_spec[1]]), offset + aligned(leaf_spec[1])
    if kind == "a":
        _, dtype, shape, is_scalar, nbytes = leaf_spec
        array = np.frombuffer(source, np.uint8, nbytes, offset).view(np.dtype(dtype)).reshape(shape)
        array = array.copy() if copy else array
        return (array[()] if is_scalar else array), offset + aligned(nbytes)
    if kind == "s":
        parts = []
        for part_spec in leaf_spec[1:]:
            part, offset = _decode_leaf(part_spec, source, offset, copy)
            parts.append(np.asarray(part))
        return SparseTensor(*parts), offset
    _, shape, lengths_nbytes, data_nbytes = leaf_spec
    lengths = np.frombuffer(source, np.int64, lengths_nbytes // 8, offset)
    offset += aligned(lengths_nbytes)
    data = bytes(source[offset : offset + data_nbytes])
    offset += aligned(data_nbytes)
    ends = np.cumsum(lengths).tolist()
    items = np.empty(len(ends), dtype=object)
    items[:] = [data[end - length : end] for end, length in zip(ends, lengths.tolist(), strict=True)]
    return items.reshape(shape), offset


def stack(elements: list[Any]) -> Any | None:
    """The elements as one, each leaf stacked along a new first axis, when they share a structure and each leaf is a
    numpy array of rank >= 1 or a numpy scalar of the same type, dtype and shape in all of them (then one encoding,
    not one per element, crosses between processes); None otherwise."""
    first = elements[0]
    if not structure.is_structure(first):
        return _stack_leaves(elements)
    columns: list[list[Any]] = []
    treedef: structure.TreeDef = None
    for element in elements:
        leaves, element_treedef = structure.flatten(element)
        if not columns:
            columns, treedef = [[leaf] for leaf in leaves], element_treedef
            continue
        if element_treedef != treedef:
            return None
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    stacked = [_stack_leaves(column) for column in columns]
    if any(leaf is None for leaf in stacked):
        return None
    return structure.pack(treedef, stacked)


def _stack_leaves(leaves: list[Any]) -> np.ndarray | None:
    first = leaves[0]
    if isinstance(first, np.generic):
        if first.dtype == object or set(map(type, leaves)) != {type(first)}:
            return None
        return np.array(leaves, dtype=first.dtype)
    if not isinstance(first, np.ndarray) or not first.ndim or first.dtype == object:
        return None
    if {(type(leaf), getattr(leaf, "dtype", None), getattr(leaf, "shape", None)) for leaf in leaves} != {
        (np.ndarray, first.dtype, first.shape)
    }:
        return None
    # Equal shapes checked above, so one concatenation does what np.stack does, without its step per array.
    return np.concatenate(leaves).reshape(len(leaves), *first.shape)


def unstack(stacked: Any, count: int) -> list[Any]:
    """The `count` elements `stack` made `stacked` of (views of its rows)."""
    if not structure.is_structure(stacked):
        return list(stacked)
    leaves, treedef = structure.flatten(stacked)
    return [structure.pack(treedef, row) for row in zip(*leaves, strict=True)]
