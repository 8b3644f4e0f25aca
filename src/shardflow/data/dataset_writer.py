"""tf.data.experimental.TFRecordWriter: writes a whole dataset of serialized records to one TFRecord file."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardflow.data.dataset import Dataset
from shardflow.data.sources import tfrecord
from shardflow.data.sources.files import compression_type_name


class TFRecordWriter:
    """`TFRecordWriter(filename, compression_type).write(dataset)` writes every element of `dataset`, each a
    bytes scalar, as one record; `compression_type` is None or "" (plain), "GZIP" or "ZLIB"."""

    def __init__(self, filename: str, compression_type: str | None = None) -> None:
        self._filename = filename
        self._compression_type = compression_type_name(compression_type)

    def write(self, dataset: Dataset[Any]) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"TFRecordWriter.write expects a shardflow.data.Dataset, got {type(dataset).__name__}")
        with tfrecord.TFRecordWriter(self._filename, self._compression_type) as writer:
            for index, element in enumerate(dataset):
                writer.write(_record(element, index))


def _record(element: Any, index: int) -> bytes:
    if isinstance(element, np.ndarray) and element.shape == () and isinstance(element[()], bytes):
        element = element[()]
    if not isinstance(element, bytes):
        raise TypeError(
            f"TFRecordWriter writes datasets of bytes scalars, but element {index} is {type(element).__name__}: "
            f"{element!r:.80}; map it to serialized bytes first"
        )
    return element
