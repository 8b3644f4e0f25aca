"""Datasets that read files (text lines, fixed-length records, TFRecord, CSV, Parquet) and TFRecordWriter."""

from shardflow.data.sources.csv import decode_csv
from shardflow.data.sources.csv_dataset import CsvDataset
from shardflow.data.sources.errors import CsvRecordError, DataLossError, InvalidRecordError
from shardflow.data.sources.fixed import FixedLengthRecordDataset
from shardflow.data.sources.make_csv import make_csv_dataset
from shardflow.data.sources.parquet import ParquetDataset
from shardflow.data.sources.text import TextLineDataset
from shardflow.data.sources.tfrecord import TFRecordDataset, TFRecordOptions, TFRecordWriter

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
