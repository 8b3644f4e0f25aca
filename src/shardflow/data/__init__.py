"""shardflow.data: a tf.data-style input pipeline of numpy elements with checkpointable iterators."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_dir, lazy_getattr
from shardflow.data import errors
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.element_spec import TensorSpec
from shardflow.data.options import (
    AUTOTUNE,
    AutoShardPolicy,
    AutotuneOptions,
    DistributeOptions,
    Options,
    ThreadingOptions,
)
from shardflow.data.sharding import auto_shard, auto_shard_for

# tf.data's names of the iterator classes: one class here, whether elements are tensors or numpy in tf.data.
Iterator = DatasetIterator
NumpyIterator = DatasetIterator

if TYPE_CHECKING:
    from shardflow.data import experimental
    from shardflow.data.example import (
        FixedLenFeature,
        SparseTensor,
        VarLenFeature,
        make_example,
        parse_example,
        parse_single_example,
    )
    from shardflow.data.sources import (
        CsvDataset,
        CsvRecordError,
        DataLossError,
        FixedLengthRecordDataset,
        InvalidRecordError,
        ParquetDataset,
        TextLineDataset,
        TFRecordDataset,
        TFRecordOptions,
        TFRecordWriter,
        decode_csv,
        make_csv_dataset,
    )
    from shardflow.data.torch_iterable import TorchIterable

# File sources and the Example codec are imported on first use: they bring protobuf (and pyarrow for Parquet),
# which a pipeline over in-memory data does not need.
_LAZY = {
    **dict.fromkeys(
        (
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
        ),
        "shardflow.data.sources",
    ),
    **dict.fromkeys(
        ("FixedLenFeature", "SparseTensor", "VarLenFeature", "make_example", "parse_example", "parse_single_example"),
        "shardflow.data.example",
    ),
    # Brings torch, which a pipeline that never meets torch does not need.
    "TorchIterable": "shardflow.data.torch_iterable",
}

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "CsvDataset",
    "CsvRecordError",
    "DataLossError",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "FixedLenFeature",
    "FixedLengthRecordDataset",
    "InvalidRecordError",
    "Iterator",
    "NumpyIterator",
    "Options",
    "ParquetDataset",
    "SparseTensor",
    "State",
    "TFRecordDataset",
    "TFRecordOptions",
    "TFRecordWriter",
    "TensorSpec",
    "TextLineDataset",
    "ThreadingOptions",
    "TorchIterable",
    "VarLenFeature",
    "auto_shard",
    "auto_shard_for",
    "decode_csv",
    "errors",
    "experimental",
    "make_csv_dataset",
    "make_example",
    "parse_example",
    "parse_single_example",
]


# tf.data.experimental's counterpart is imported on first use, as the file sources are.
_LAZY["experimental"] = "shardflow.data.experimental"

__getattr__ = lazy_getattr(__name__, _LAZY, submodules=("experimental",))
__dir__ = lazy_dir(__name__, _LAZY)
