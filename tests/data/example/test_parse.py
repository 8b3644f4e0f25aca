"""parse_example and parse_single_example: dense and sparse outputs, defaults, and errors naming feature and record."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from shardflow.data.example import (
    FixedLenFeature,
    SparseTensor,
    VarLenFeature,
    make_example,
    parse_example,
    parse_single_example,
)
from shardflow.data.example.parse import Parsed

RECORDS = [
    make_example({"x": [1.0, 2.0], "y": [7], "id": b"a", "tags": [b"p", b"q"]}),
    make_example({"x": [3.0, 4.0], "id": "b"}),
    make_example({"x": [5.0, 6.0], "y": [-9], "id": b"c", "tags": [b"r"]}),
]


def dense(parsed: Parsed, name: str) -> npt.NDArray[Any]:
    value = parsed[name]
    assert not isinstance(value, SparseTensor), name
    return value


def sparse(parsed: Parsed, name: str) -> SparseTensor:
    value = parsed[name]
    assert isinstance(value, SparseTensor), name
    return value


def test_fixed_len_features_give_one_row_per_record_in_their_shape_and_dtype():
    parsed = parse_example(
        RECORDS,
        {
            "x": FixedLenFeature((2,), np.float32),
            "y": FixedLenFeature((), np.int64, default_value=0),
            "id": FixedLenFeature((), bytes),
        },
    )
    np.testing.assert_array_equal(parsed["x"], np.array([[1, 2], [3, 4], [5, 6]], np.float32))
    assert dense(parsed, "x").dtype == np.float32
    np.testing.assert_array_equal(parsed["y"], np.array([7, 0, -9], np.int64))
    assert dense(parsed, "id").dtype == object and dense(parsed, "id").tolist() == [b"a", b"b", b"c"]


def test_a_missing_fixed_len_feature_takes_its_default_reshaped_to_the_feature_shape():
    record = make_example({"other": [1]})
    parsed = parse_example([record], {"m": FixedLenFeature((2, 2), np.float32, default_value=[[1, 2], [3, 4]])})
    np.testing.assert_array_equal(parsed["m"], np.array([[[1, 2], [3, 4]]], np.float32))
    parsed = parse_example([record], {"s": FixedLenFeature((2,), "string", default_value="none")})
    assert dense(parsed, "s").tolist() == [[b"none", b"none"]]


def test_var_len_features_give_sparse_indices_values_and_dense_shape():
    parsed = parse_example(RECORDS, {"tags": VarLenFeature(bytes)})
    tags = parsed["tags"]
    assert isinstance(tags, SparseTensor)
    assert tags.indices.tolist() == [[0, 0], [0, 1], [2, 0]]
    assert tags.values.tolist() == [b"p", b"q", b"r"]
    assert tags.dense_shape.tolist() == [3, 2]


def test_parse_single_example_drops_the_batch_dimension():
    parsed = parse_single_example(RECORDS[0], {"x": FixedLenFeature((2,), np.float32), "tags": VarLenFeature(bytes)})
    np.testing.assert_array_equal(parsed["x"], np.array([1, 2], np.float32))
    assert sparse(parsed, "tags").indices.tolist() == [[0], [1]]
    assert sparse(parsed, "tags").dense_shape.tolist() == [2]


def test_a_numpy_object_array_of_records_parses_like_a_list():
    spec = {"x": FixedLenFeature((2,), np.float32)}
    np.testing.assert_array_equal(
        parse_example(np.array(RECORDS, dtype=object), spec)["x"], parse_example(RECORDS, spec)["x"]
    )


def test_an_empty_batch_gives_empty_outputs():
    parsed = parse_example([], {"x": FixedLenFeature((2,), np.float32), "v": VarLenFeature(np.int64)})
    assert dense(parsed, "x").shape == (0, 2)
    assert sparse(parsed, "v").indices.shape == (0, 2) and sparse(parsed, "v").dense_shape.tolist() == [0, 0]


def test_a_required_feature_missing_from_a_record_names_the_feature_and_the_record():
    with pytest.raises(ValueError, match=r"feature 'y' is required .* missing in record 1"):
        parse_example(RECORDS, {"y": FixedLenFeature((), np.int64)})


def test_a_feature_with_the_wrong_number_of_values_names_the_feature_and_the_record():
    with pytest.raises(ValueError, match=r"feature 'tags' of record 2 has 1 values, but its shape \[2\] needs 2"):
        parse_example(RECORDS, {"tags": FixedLenFeature((2,), bytes, default_value=[b"", b""])})


def test_a_feature_of_another_type_names_the_feature_the_record_and_both_types():
    with pytest.raises(ValueError, match=r"feature 'y' of record 0 holds int64 values, but its spec expects float"):
        parse_example(RECORDS, {"y": VarLenFeature(np.float32)})


def test_a_record_that_is_not_an_example_is_named():
    with pytest.raises(ValueError, match=r"record 1 is not a serialized tf\.train\.Example"):
        parse_example([RECORDS[0], b"\xff\xff\xff"], {"x": VarLenFeature(np.float32)})


def test_feature_specs_accept_only_the_three_example_types():
    with pytest.raises(ValueError, match="float32, int64 or string"):
        FixedLenFeature((), np.float64)
    with pytest.raises(ValueError, match="default_value has 3 values"):
        FixedLenFeature((2,), np.int64, default_value=[1, 2, 3])


def test_make_example_infers_the_list_type_and_flattens_arrays():
    parsed = parse_single_example(
        make_example({"f": np.ones((2, 2)), "i": np.array([[1], [2]]), "b": True, "s": ["x", b"y"]}),
        {
            "f": FixedLenFeature((4,), np.float32),
            "i": FixedLenFeature((2,), np.int64),
            "b": FixedLenFeature((), np.int64),
            "s": FixedLenFeature((2,), bytes),
        },
    )
    assert dense(parsed, "f").tolist() == [1, 1, 1, 1] and dense(parsed, "i").tolist() == [1, 2] and parsed["b"] == 1
    assert dense(parsed, "s").tolist() == [b"x", b"y"]
    with pytest.raises(ValueError, match="empty list"):
        make_example({"e": []})


def test_fixed_len_feature_takes_tf_style_list_and_int_shapes_as_tuples():
    # tf.io.FixedLenFeature([3], tf.float32) is how ported code spells it; the field is typed as the tuple it becomes.
    as_list = FixedLenFeature(cast(Any, [3]), np.float32)
    as_int = FixedLenFeature(cast(Any, 3), np.float32)
    assert as_list.shape == as_int.shape == (3,)
    assert as_list == FixedLenFeature((3,), np.float32)
