"""make_example: a dict of values to a serialized tf.train.Example."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardflow.data.example import example_pb2


def make_example(features: Mapping[str, Any]) -> bytes:
    """Serialize {name: value} as a tf.train.Example. A value is a scalar, a list or a numpy array (of any
    shape, flattened): floats become a FloatList (as float32), integers and bools an Int64List, bytes and str
    a BytesList (str as UTF-8). An empty list needs a numpy dtype to say which."""
    example = example_pb2.Example()
    feature_map = example.features.feature
    for name, value in features.items():
        array = _as_array(name, value)
        if array.dtype.kind == "f":
            feature_map[name].float_list.value.extend(array.astype(np.float32).tolist())
        elif array.dtype.kind in "iub":
            feature_map[name].int64_list.value.extend(array.astype(np.int64).tolist())
        else:
            feature_map[name].bytes_list.value.extend(
                item.encode() if isinstance(item, str) else bytes(item) for item in array.tolist()
            )
    serialized: bytes = example.SerializeToString()
    return serialized


def _as_array(name: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, bytes | str):
        return np.array([value], dtype=object)
    if isinstance(value, np.ndarray):
        array = value
    else:
        items = list(value) if isinstance(value, list | tuple) else [value]
        if any(isinstance(item, bytes | str) for item in items):
            array = np.array(items, dtype=object)
        else:
            if not items:
                raise ValueError(f"feature {name!r}: an empty list has no type; pass an empty numpy array with a dtype")
            array = np.asarray(items)
    if array.dtype.kind not in "fiubOSU":
        raise ValueError(f"feature {name!r}: cannot store values of dtype {array.dtype} in an Example")
    return array.reshape(-1)
