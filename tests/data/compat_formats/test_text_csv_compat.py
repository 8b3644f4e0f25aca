"""Text lines, fixed-length records and CSV decode as TensorFlow 2.21 decodes them."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gzip
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow.data.sources import (
    CsvDataset,
    CsvRecordError,
    FixedLengthRecordDataset,
    TextLineDataset,
    decode_csv,
    make_csv_dataset,
)


def test_text_lines_with_crlf_lone_cr_and_no_final_newline_equal_tf_data(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"]
    files[0].write_bytes(b"a\r\nb\rc\n\nd\r\n\r\ne")
    files[1].write_bytes(b"")
    files[2].write_bytes(b"x\n\r")
    names = [str(path) for path in files]
    assert list(TextLineDataset(names, buffer_size=3)) == list(tf.data.TextLineDataset(names).as_numpy_iterator())


def test_gzip_text_lines_equal_tf_data(tmp_path):
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress(b"one\r\ntwo\nthree"))
    expected = list(tf.data.TextLineDataset(str(path), "GZIP").as_numpy_iterator())
    assert list(TextLineDataset(str(path), "GZIP")) == expected


def test_fixed_length_records_with_header_and_footer_equal_tf_data(tmp_path):
    names = []
    for index, body in enumerate([b"0123456789ab", b"wxyz"]):
        names.append(str(tmp_path / f"{index}.bin"))
        (tmp_path / f"{index}.bin").write_bytes(b"HDR" + body + b"FOOT")
    mine = list(FixedLengthRecordDataset(names, 4, header_bytes=3, footer_bytes=4, buffer_size=5))
    theirs = list(tf.data.FixedLengthRecordDataset(names, 4, header_bytes=3, footer_bytes=4).as_numpy_iterator())
    assert mine == theirs


CSV_CASES = [
    (["1,2.5,abc", '"2","3",""', " 3 , 4.5 ,x y"], [[0], [0.0], ["none"]], {}),
    (['1,"a""b",c', '2,"x,y",', "3,,z"], [[0], [""], ["d"]], {}),
    (["1,NA,c", '"NA",2.5,e'], [[7], [5.0], ["d"]], {"na_value": "NA"}),
    (["1;2;3;4", "5;6;7;8"], [[0], [np.int64(0)]], {"field_delim": ";", "select_cols": [0, 2]}),
    (['a"b,1', '"q",2'], [[""], [0.0]], {"use_quote_delim": False}),
    (["1e3,inf,-1", "nan,-0.5,2147483648"], [[0.0], [np.float64(0)], [np.int64(0)]], {}),
]


def tf_default(default):
    return [tf.constant(default[0])] if isinstance(default[0], np.generic) else default


@pytest.mark.parametrize(("records", "defaults", "options"), CSV_CASES)
def test_decode_csv_with_quotes_and_defaults_equals_tf_io_decode_csv(records, defaults, options):
    theirs = tf.io.decode_csv(records, [tf_default(default) for default in defaults], **options)
    mine = decode_csv(records, defaults, **options)
    assert len(mine) == len(theirs)
    for column, expected in zip(mine, theirs, strict=True):
        assert column.dtype == expected.numpy().dtype
        np.testing.assert_array_equal(column, expected.numpy())


@pytest.mark.parametrize(
    ("record", "defaults"),
    [("1,2", [[0], [0], [0]]), ("1,,3", [[0], [], [0]]), ("1.5,2", [[0], [0]]), ('1,"a"b', [[0], [""]])],
)
def test_decode_csv_refuses_what_tf_io_decode_csv_refuses(record, defaults):
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.io.decode_csv([record], defaults)
    with pytest.raises(CsvRecordError, match="record 0"):
        decode_csv([record], defaults)


def test_csv_dataset_and_make_csv_dataset_equal_tf_data(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes(b'a,b,c,d\n1,2.5,x,3000000000\n2,,"y,z",4\r\n3,4,w,5\n')
    defaults = [[0], [0.0], [""], [np.int64(0)]]
    tf_rows = tf.data.experimental.CsvDataset(str(path), [tf_default(d) for d in defaults], header=True)
    mine = list(CsvDataset(str(path), defaults, header=True))
    assert [[(np.asarray(value).dtype, value) for value in row] for row in mine] == [
        [(np.asarray(value).dtype, value) for value in row] for row in tf_rows.as_numpy_iterator()
    ]
    options: dict[str, Any] = {
        "batch_size": 2,
        "label_name": "a",
        "shuffle": False,
        "num_epochs": 1,
        "select_columns": ["a", "c", "d"],
    }
    theirs = list(tf.data.experimental.make_csv_dataset(str(path), **options).as_numpy_iterator())
    batches = list(make_csv_dataset(str(path), **options))
    assert len(batches) == len(theirs)
    for (features, label), (tf_features, tf_label) in zip(batches, theirs, strict=True):
        assert list(features) == list(tf_features)
        for name in features:
            assert (
                features[name].dtype == tf_features[name].dtype
                and features[name].tolist() == tf_features[name].tolist()
            )
        assert label.dtype == tf_label.dtype and label.tolist() == tf_label.tolist()
