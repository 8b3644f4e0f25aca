"""tf.train.Example for shardflow: build records, and parse batches of them into numpy arrays."""

from shardflow.data.example.build import make_example
from shardflow.data.example.features import FixedLenFeature, VarLenFeature
from shardflow.data.example.parse import parse_example, parse_single_example
from shardflow.data.sparse import SparseTensor

__all__ = [
    "FixedLenFeature",
    "SparseTensor",
    "VarLenFeature",
    "make_example",
    "parse_example",
    "parse_single_example",
]
