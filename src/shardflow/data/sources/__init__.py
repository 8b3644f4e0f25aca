"""Datasets that read files (text lines, fixed-length records, TFRecord, CSV, Parquet) and TFRecordWriter; and, in
their own modules, the sources that `Dataset`'s constructors build (in_memory, generator, list_files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from shardflow.data.sources.csv import decode_csv
    from shardflow.data.sources.csv_dataset import CsvDataset
    from shardflow.data.sources.errors import CsvRecordError, DataLossError, InvalidRecordError
    from shardflow.data.sources.fixed import FixedLengthRecordDataset
    from shardflow.data.sources.make_csv import make_csv_dataset
    from shardflow.data.sources.parquet import ParquetDataset
    from shardflow.data.sources.text import TextLineDataset
    from shardflow.data.sources.tfrecord import TFRecordDataset, TFRecordOptions, TFRecordWriter

# Imported on first use, so that `Dataset.range()`, which imports the in-memory sources of this package, does not
# load every file format's reader.
_LAZY = {
    "CsvDataset": "shardflow.data.sources.csv_dataset",
    "CsvRecordError": "shardflow.data.sources.errors",
    "DataLossError": "shardflow.data.sources.errors",
    "FixedLengthRecordDataset": "shardflow.data.sources.fixed",
    "InvalidRecordError": "shardflow.data.sources.errors",
    "ParquetDataset": "shardflow.data.sources.parquet",
    "TFRecordDataset": "shardflow.data.sources.tfrecord",
    "TFRecordOptions": "shardflow.data.sources.tfrecord",
    "TFRecordWriter": "shardflow.data.sources.tfrecord",
    "TextLineDataset": "shardflow.data.sources.text",
    "decode_csv": "shardflow.data.sources.csv",
    "make_csv_dataset": "shardflow.data.sources.make_csv",
}

__all__ = [
    "CsvDataset",
    "CsvRecordError",
    "DataLossError",
    "FixedLengthRecordDataset",
    "InvalidRecordError",
    "ParquetDataset",
    "TFRecordDataset",
    "TFRecordOptions",
    "TFRecordWriter",
    "TextLineDataset",
    "decode_csv",
    "make_csv_dataset",
]

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
