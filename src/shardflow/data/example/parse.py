"""parse_example and parse_single_example: serialized tf.train.Example records to numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.errors import InvalidArgumentError
from shardflow.data.example.decode import decode_columns
from shardflow.data.example.features import Column, FixedLenFeature, VarLenFeature
from shardflow.data.sparse import SparseTensor

Feature = FixedLenFeature | VarLenFeature
Parsed = dict[str, npt.NDArray[Any] | SparseTensor]


def parse_example(serialized: Any, features: Mapping[str, Feature]) -> Parsed:
    """Parse a batch of serialized Examples (a list of bytes or a 1-D numpy array of them), as tf.io.parse_example.

    A FixedLenFeature gives an array of shape (batch, *shape); a VarLenFeature a SparseTensor with indices
    (value count, 2) and dense_shape (batch, longest list). Errors (a required feature missing, a wrong
    number or type of values, a malformed record) raise InvalidArgumentError (a ValueError) naming the feature and
    the record.
    """
    records = _records(serialized)
    columns = decode_columns(records, {name: spec.dtype for name, spec in features.items()})
    parsed: Parsed = {}
    for name, spec in features.items():
        if isinstance(spec, FixedLenFeature):
            parsed[name] = _dense(name, spec, columns[name], len(records))
        elif isinstance(spec, VarLenFeature):
            parsed[name] = _sparse(columns[name], len(records))
        else:
            raise TypeError(f"feature {name!r}: expected a FixedLenFeature or VarLenFeature, got {type(spec)}")
    return parsed


def parse_single_example(serialized: bytes, features: Mapping[str, Feature]) -> Parsed:
    """Parse one serialized Example (tf.io.parse_single_example): as parse_example without the batch dimension."""
    if not isinstance(serialized, bytes | np.bytes_):
        raise TypeError(f"serialized must be bytes, got {type(serialized)}")
    parsed = parse_example([bytes(serialized)], features)
    for name, value in parsed.items():
        if isinstance(value, SparseTensor):
            parsed[name] = SparseTensor(value.indices[:, 1:], value.values, value.dense_shape[1:])
        else:
            parsed[name] = value[0]
    return parsed


def _records(serialized: Any) -> list[bytes]:
    if isinstance(serialized, bytes | str):
        raise TypeError("parse_example takes a batch of records; use parse_single_example for one")
    if isinstance(serialized, np.ndarray):
        if serialized.ndim != 1:
            raise InvalidArgumentError(f"serialized must be a 1-D batch of records, got shape {serialized.shape}")
        # A fixed-width bytes ("S") array has lost the trailing zero bytes of its records; an object array has not.
        return serialized.tolist()  # type: ignore[no-any-return]
    return list(serialized)


def _dense(name: str, spec: FixedLenFeature, column: Column, batch_size: int) -> npt.NDArray[Any]:
    size = spec.size
    wrong = np.flatnonzero(column.counts != size)
    if wrong.size:
        raise InvalidArgumentError(
            f"feature {name!r} of record {column.records[wrong[0]]} has {column.counts[wrong[0]]} values, "
            f"but its shape {list(spec.shape)} needs {size}"
        )
    values = column.values.reshape(-1, size)
    if column.records.size < batch_size:
        if spec.default_value is None:
            missing = np.setdiff1d(np.arange(batch_size), column.records)[0]
            raise InvalidArgumentError(
                f"feature {name!r} is required (it has no default_value) but missing in record {missing}"
            )
        dense = np.empty((batch_size, size), dtype=spec.dtype)
        dense[:] = spec.default_array()
        dense[column.records] = values
        values = dense
    return values.reshape((batch_size, *spec.shape))


def _sparse(column: Column, batch_size: int) -> SparseTensor:
    counts = column.counts
    starts = np.cumsum(counts) - counts
    rows = np.repeat(column.records, counts)
    positions = np.arange(rows.size, dtype=np.int64) - np.repeat(starts, counts)
    longest = int(counts.max(initial=0))
    return SparseTensor(
        indices=np.stack([rows, positions], axis=1).astype(np.int64, copy=False),
        values=column.values,
        dense_shape=np.array([batch_size, longest], dtype=np.int64),
    )
