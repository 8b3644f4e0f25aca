"""TFRecord files interchange with TensorFlow 2.21 both ways, plain and compressed."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest
import tensorflow as tf

from shardflow.data.sources import TFRecordDataset, TFRecordWriter

RECORDS = [b"", b"first", bytes(range(256)) * 3, b"last"]


@pytest.mark.parametrize("compression_type", ["", "GZIP", "ZLIB"])
def test_files_written_by_tensorflow_read_back_record_for_record(tmp_path, compression_type):
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path, compression_type) as writer:
        for record in RECORDS:
            writer.write(record)
    assert list(TFRecordDataset(path, compression_type, buffer_size=100)) == RECORDS


@pytest.mark.parametrize("compression_type", ["", "GZIP", "ZLIB"])
def test_files_written_by_shardflow_read_by_tensorflow_record_for_record(tmp_path, compression_type):
    path = str(tmp_path / "shardflow.tfrecord")
    with TFRecordWriter(path, compression_type) as writer:
        for record in RECORDS:
            writer.write(record)
    assert list(tf.data.TFRecordDataset(path, compression_type).as_numpy_iterator()) == RECORDS


def test_num_parallel_reads_interleaves_files_in_tensorflows_order(tmp_path):
    files = []
    for name, count in (("a", 3), ("b", 1), ("c", 2)):
        files.append(str(tmp_path / f"{name}.tfrecord"))
        with TFRecordWriter(files[-1]) as writer:
            for index in range(count):
                writer.write(f"{name}{index}".encode())
    expected = list(tf.data.TFRecordDataset(files, num_parallel_reads=2).as_numpy_iterator())
    assert list(TFRecordDataset(files, num_parallel_reads=2)) == expected
