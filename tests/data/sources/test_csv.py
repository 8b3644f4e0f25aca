"""decode_csv, CsvDataset and make_csv_dataset: types, defaults, quotes, errors naming file and line, resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.data.sources import CsvDataset, CsvRecordError, InvalidRecordError, decode_csv, make_csv_dataset
from shardflow.data.sources.csv import _convert, _split_each
from shardflow.data.sources.csv_arrow import decode_with_arrow
from shardflow.data.sources.csv_format import CsvFormat


def test_one_record_gives_numpy_scalars_and_bytes():
    assert decode_csv("1,2.5,abc", [[0], [0.0], [""]]) == [np.int32(1), np.float32(2.5), b"abc"]
    assert [type(value) for value in decode_csv(b"1,2.5,abc", [[0], [0.0], [""]])] == [np.int32, np.float32, bytes]


def test_a_batch_gives_one_array_per_column_shaped_like_the_records():
    ints, strings = decode_csv(np.array([["1,a", "2,b"], ["3,c", "4,d"]]), [[np.int64(0)], [""]])
    assert ints.dtype == np.int64 and ints.tolist() == [[1, 2], [3, 4]]
    assert strings.dtype == object and strings.tolist() == [[b"a", b"b"], [b"c", b"d"]]


def test_empty_and_na_fields_take_the_column_default():
    floats, strings = decode_csv(["NA,", ",x", "1.5,NA"], [[7.0], ["d"]], na_value="NA")
    assert floats.tolist() == [7.0, 7.0, 1.5] and strings.tolist() == [b"d", b"x", b"d"]


def test_quoted_fields_may_hold_delimiters_and_doubled_quotes():
    (fields,) = decode_csv(['"a,b"', '"say ""hi"""', '""'], [["empty"]])
    assert fields.tolist() == [b"a,b", b'say "hi"', b"empty"]


def test_select_cols_keeps_only_those_columns_and_ignores_later_fields():
    first, third = decode_csv(["1,2,3,4", "5,6,7"], [[0], [0]], select_cols=[0, 2])
    assert first.tolist() == [1, 5] and third.tolist() == [3, 7]


def test_dtypes_and_empty_lists_make_required_columns():
    with pytest.raises(CsvRecordError, match=r"record 1: field 1 is required but missing"):
        decode_csv(["1,2", "3,"], [np.int32, []])


def test_a_record_with_the_wrong_number_of_fields_is_named():
    with pytest.raises(CsvRecordError, match=r"record 2: expected 2 fields but found 3: b'5,6,7'"):
        decode_csv(["1,2", "3,4", "5,6,7"], [[0], [0]])


def test_an_unparsable_number_is_named_with_its_field_and_record():
    with pytest.raises(CsvRecordError, match=r"record 1: field 0 is not a valid int32: b'2147483648'"):
        decode_csv(["1", "2147483648"], [[0]])


@pytest.mark.parametrize("record", ['a"b', '"ab"c', '"open'])
def test_stray_quotes_are_errors_unless_use_quote_delim_is_false(record):
    with pytest.raises(CsvRecordError, match="quote"):
        decode_csv([record], [[""]])
    assert decode_csv([record], [[""]], use_quote_delim=False)[0].tolist() == [record.encode()]


field_text = st.text(alphabet="abc 12.-", max_size=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.one_of(field_text, st.just('"q,""x"'), st.just("")), min_size=3, max_size=3), max_size=8))
def test_a_batch_decodes_as_its_records_decode_one_by_one(rows):
    records = [",".join(row) for row in rows]
    defaults = [["d"], ["e"], ["f"]]
    batch = decode_csv(records, defaults)
    for index, record in enumerate(records):
        assert [column[index] for column in batch] == decode_csv(record, defaults)


def write_csv(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_csv_dataset_yields_one_tuple_per_line_after_each_header(tmp_path):
    files = [write_csv(tmp_path, "a.csv", b"x,y\n1,a\n2,b"), write_csv(tmp_path, "b.csv", b"x,y\r\n3,c\r\n")]
    rows = list(CsvDataset(files, [[0], [""]], header=True))
    assert rows == [(1, b"a"), (2, b"b"), (3, b"c")]
    assert type(rows[0][0]) is np.int32


def test_a_bad_line_names_the_file_and_line_after_the_rows_before_it_and_reading_goes_on(tmp_path):
    path = write_csv(tmp_path, "rows.csv", b"x,y\n1,a\n2\n3,c\n")
    rows = iter(CsvDataset(path, [[0], [""]], header=True))
    assert next(rows) == (1, b"a")
    with pytest.raises(
        InvalidRecordError, match=r"rows\.csv:3: expected 2 fields but found 1 at byte offset 8"
    ) as caught:
        next(rows)
    assert (caught.value.filename, caught.value.line, caught.value.offset) == (path, 3, 8)
    assert list(rows) == [(3, b"c")]


def test_exclude_cols_drops_those_columns(tmp_path):
    path = write_csv(tmp_path, "rows.csv", b"1,a,2.5\n")
    assert list(CsvDataset(path, [[0], [0.0]], exclude_cols=[1])) == [(1, np.float32(2.5))]


@pytest.mark.parametrize("buffer_size", [4, None])
def test_resume_mid_file_across_files_and_after_a_bad_line(tmp_path, buffer_size):
    files = [write_csv(tmp_path, "a.csv", b"h\n1\n2\nbad\n3\n"), write_csv(tmp_path, "b.csv", b"h\n4\n5\n")]
    dataset = CsvDataset(files, [[0]], header=True, buffer_size=buffer_size)

    def drain(iterator):
        out = []
        while True:
            try:
                out.append(next(iterator))
            except StopIteration:
                return out
            except InvalidRecordError:
                out.append("error")

    full = drain(iter(dataset))
    assert full == [(1,), (2,), "error", (3,), (4,), (5,)]
    for taken in range(len(full) + 1):
        iterator = iter(dataset)
        head = drain_some(iterator, taken)
        resumed = iter(dataset)
        resumed.set_state(iterator.get_state())
        assert head + drain(resumed) == full


def drain_some(iterator, count):
    out: list[Any] = []
    while len(out) < count:
        try:
            out.append(next(iterator))
        except InvalidRecordError:
            out.append("error")
    return out


def test_make_csv_dataset_reads_names_from_the_header_infers_types_and_splits_off_the_label(tmp_path):
    path = write_csv(tmp_path, "rows.csv", b"age,score,name,big\n31,1.5,ann,3000000000\n42,,bob,4\n7,2,cy,5\n")
    batches = list(make_csv_dataset(path, batch_size=2, label_name="age", shuffle=False, num_epochs=1))
    features, label = batches[0]
    assert sorted(features) == ["big", "name", "score"]
    assert label.dtype == np.int32 and label.tolist() == [31, 42]
    assert features["score"].dtype == np.float32 and features["score"].tolist() == [1.5, 0.0]
    assert features["name"].tolist() == [b"ann", b"bob"]
    assert features["big"].dtype == np.int64
    assert [len(batch[1]) for batch in batches] == [2, 1]


def test_make_csv_dataset_select_columns_and_repeat_forever_drops_the_partial_batch(tmp_path):
    path = write_csv(tmp_path, "rows.csv", b"a,b,c\n1,x,2\n3,y,4\n5,z,6\n")
    dataset = make_csv_dataset(path, batch_size=2, select_columns=["c", "a"], shuffle=False, column_defaults=[[0], [0]])
    iterator = iter(dataset)
    batches = [next(iterator) for _ in range(3)]
    assert [batch["a"].tolist() for batch in batches] == [[1, 3], [5, 1], [3, 5]]
    assert sorted(batches[0]) == ["a", "c"]


def test_make_csv_dataset_names_a_pattern_that_matches_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-"):
        make_csv_dataset(str(tmp_path / "nothing-*.csv"), batch_size=1)


COLUMN_DTYPES = [np.int32, np.int64, np.float32, np.float64, bytes]
field = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.floats(allow_nan=True, width=64).map(lambda value: f"{value:.12g}"),
    st.sampled_from(["", "NA", " 7", "+3", "1e5", "-0", "inf", "nan", "abc", "2147483648", "9" * 20]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(COLUMN_DTYPES), st.booleans()), min_size=1, max_size=4).flatmap(
        lambda columns: st.tuples(
            st.just(columns), st.lists(st.lists(field, min_size=len(columns), max_size=len(columns)), max_size=5)
        )
    )
)
def test_the_pyarrow_path_decodes_exactly_as_the_record_by_record_parser(case):
    columns, rows = case
    defaults = [
        np.array([], dtype) if required else np.array([0 if dtype is not bytes else b"-"], dtype)
        for dtype, required in columns
    ]
    csv_format = CsvFormat.of(defaults, na_value="NA")
    lines = [",".join(row).encode() for row in rows]
    fast = decode_with_arrow(lines, b"\n".join(lines), csv_format)
    if fast is None:
        return
    reference = _split_each(lines, csv_format)
    for index, column in enumerate(fast):
        expected = _convert(reference[:, index], index, csv_format, lines)
        assert column.dtype == expected.dtype
        np.testing.assert_array_equal(column, expected)


def test_defaults_that_compare_equal_but_differ_are_not_mixed_up_by_the_format_cache():
    (_, negative) = decode_csv(["1,"], [[0], [-0.0]])
    (_, positive) = decode_csv(["1,"], [[0], [0.0]])
    assert np.signbit(negative[0]) and not np.signbit(positive[0])
    (_, ints) = decode_csv(["1,", "1,2"], [[0], [1]])
    (_, floats) = decode_csv(["1,", "1,2"], [[0], [1.0]])
    assert ints.dtype == np.int32 and floats.dtype == np.float32


def test_a_record_holding_a_line_break_is_left_to_the_record_parser():
    lines = [b"1,a", b"2,b\nc"]
    assert decode_with_arrow(lines, b"\n".join(lines), CsvFormat.of([[0], [""]])) is None
    with pytest.raises(CsvRecordError, match="line breaks"):
        decode_csv(lines, [[0], [""]])


def test_plain_batches_of_the_benchmark_shape_take_the_pyarrow_path():
    lines = [
        (",".join(f"{column * 0.5 + row:.6f}" for column in range(16)) + f",{row % 10}").encode() for row in range(300)
    ]
    columns = decode_with_arrow(lines, b"\n".join(lines), CsvFormat.of([[0.0]] * 16 + [[0]]))
    assert columns is not None and columns[3][7] == np.float32(8.5) and columns[16].tolist()[:12] == [*range(10), 0, 1]
