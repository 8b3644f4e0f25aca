"""tf.train.Example interchange with TensorFlow 2.21: TF's Examples parsed by shardflow, shardflow's by TF."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

from shardflow.data.example import FixedLenFeature, VarLenFeature, make_example, parse_example, parse_single_example


def tf_example(features: dict) -> bytes:
    feature = {}
    for name, values in features.items():
        if isinstance(values[0], bytes):
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        elif isinstance(values[0], float):
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        else:
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


ROWS = [
    {"x": [0.5, -1.25, 3e38], "label": [1], "id": [b"u1"], "tags": [b"a", b"b"], "ids": [2**40, -7]},
    {"x": [1.0, 2.0, 3.0], "id": [b""], "tags": [b"c"]},
    {"x": [float("inf"), 0.0, -0.0], "label": [-(2**63)], "id": [b"\x00\xff"], "ids": [0]},
]
SHARDFLOW_SPEC: dict[str, FixedLenFeature | VarLenFeature] = {
    "x": FixedLenFeature((3,), np.float32),
    "label": FixedLenFeature((), np.int64, default_value=-1),
    "id": FixedLenFeature((), bytes),
    "tags": VarLenFeature(bytes),
    "ids": VarLenFeature(np.int64),
    "absent": FixedLenFeature((2,), np.float32, default_value=[9.0, 8.0]),
}
TF_SPEC = {
    "x": tf.io.FixedLenFeature([3], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "id": tf.io.FixedLenFeature([], tf.string),
    "tags": tf.io.VarLenFeature(tf.string),
    "ids": tf.io.VarLenFeature(tf.int64),
    "absent": tf.io.FixedLenFeature([2], tf.float32, default_value=[9.0, 8.0]),
}


def assert_parsed_equal(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for name, expected in theirs.items():
        if isinstance(expected, tf.SparseTensor):
            np.testing.assert_array_equal(mine[name].indices, expected.indices.numpy(), err_msg=name)
            assert mine[name].values.tolist() == expected.values.numpy().tolist(), name
            np.testing.assert_array_equal(mine[name].dense_shape, expected.dense_shape.numpy(), err_msg=name)
        else:
            theirs_value = np.asarray(expected.numpy(), dtype=object if expected.dtype == tf.string else None)
            value = np.asarray(mine[name], dtype=object if expected.dtype == tf.string else None)
            assert value.dtype == theirs_value.dtype, name
            assert value.tolist() == theirs_value.tolist(), name


def test_examples_built_by_tensorflow_parse_as_tensorflow_parses_them():
    records = [tf_example(row) for row in ROWS]
    assert_parsed_equal(parse_example(records, SHARDFLOW_SPEC), tf.io.parse_example(records, TF_SPEC))


def test_a_single_tensorflow_example_parses_as_tf_io_parse_single_example():
    record = tf_example(ROWS[0])
    assert_parsed_equal(parse_single_example(record, SHARDFLOW_SPEC), tf.io.parse_single_example(record, TF_SPEC))


def test_examples_made_by_shardflow_parse_in_tensorflow_with_the_same_values():
    records = [make_example(row) for row in ROWS]
    assert_parsed_equal(parse_example(records, SHARDFLOW_SPEC), tf.io.parse_example(records, TF_SPEC))
    assert tf.train.Example.FromString(records[0]).features.feature["ids"].int64_list.value == [2**40, -7]
