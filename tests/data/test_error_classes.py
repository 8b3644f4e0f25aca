"""shardflow.data.errors: tf.errors' names that are also the Python exceptions they resemble, raised where the
sources and iterators fail; and get_next / get_next_as_optional on shardflow's iterators."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from shardflow import data
from shardflow.data import errors
from shardflow.data.sources import errors as source_errors

D = data.Dataset


@pytest.mark.parametrize(
    "error, builtin",
    [
        (errors.InvalidArgumentError, ValueError),
        (errors.NotFoundError, FileNotFoundError),
        (errors.PermissionDeniedError, PermissionError),
        (errors.DataLossError, ValueError),
        (errors.FailedPreconditionError, RuntimeError),
        (errors.UnimplementedError, NotImplementedError),
        (errors.ResourceExhaustedError, MemoryError),
    ],
)
def test_each_error_is_also_the_python_exception_it_resembles(error: type, builtin: type) -> None:
    assert issubclass(error, builtin) and issubclass(error, errors.OpError)


def test_out_of_range_is_not_stop_iteration() -> None:
    # A StopIteration raised by get_next() inside a map function would silently end the outer pipeline.
    assert not issubclass(errors.OutOfRangeError, StopIteration)


def test_the_sources_errors_are_the_same_classes() -> None:
    assert source_errors.DataLossError is errors.DataLossError is data.DataLossError
    assert issubclass(source_errors.InvalidRecordError, errors.InvalidArgumentError)
    assert issubclass(source_errors.CsvRecordError, errors.InvalidArgumentError)


def test_error_codes_are_tf_codes() -> None:
    codes = {name: getattr(errors, name).error_code for name in ("InvalidArgumentError", "OutOfRangeError")}
    assert codes == {"InvalidArgumentError": 3, "OutOfRangeError": 11}


def test_data_loss_error_survives_pickling_with_its_position() -> None:
    error = pickle.loads(pickle.dumps(errors.DataLossError("a.tfrecord", 12, "corrupt record length")))
    assert (error.filename, error.offset, error.message) == (
        "a.tfrecord",
        12,
        "a.tfrecord: corrupt record length at byte offset 12",
    )


def test_a_missing_file_raises_not_found_naming_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.tfrecord")
    with pytest.raises(errors.NotFoundError) as raised:
        list(D.range(1).interleave(lambda _: data.TFRecordDataset(missing)))
    assert raised.value.filename == missing


def test_list_files_without_a_match_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no files matched pattern"):
        D.list_files(str(tmp_path / "*.csv"))


def test_get_next_and_next_share_one_position() -> None:
    iterator = iter(D.range(4))
    assert next(iterator) == 0
    assert iterator.get_next() == 1
    assert iterator.get_next_as_optional().get_value() == 2
    assert iterator.get_state() == {"index": 3}


def test_an_empty_optional_says_so() -> None:
    empty = data.experimental.Optional.empty(data.TensorSpec((), "int64"))
    assert not empty.has_value()
    assert empty.element_spec == data.TensorSpec((), "int64")
    assert repr(empty) == "Optional.empty()"
    with pytest.raises(errors.InvalidArgumentError, match="does not have a value"):
        empty.get_value()
