"""FixedLengthRecordDataset: records between header and footer, partial records, compression, exact resume."""

from __future__ import annotations

import gzip

import pytest

from shardflow.data.sources import DataLossError, FixedLengthRecordDataset


def test_records_are_cut_between_the_header_and_the_footer(write):
    path = write("a.bin", b"HDR" + b"0123456789ab" + b"FT")
    dataset = FixedLengthRecordDataset(path, record_bytes=4, header_bytes=3, footer_bytes=2)
    assert list(dataset) == [b"0123", b"4567", b"89ab"]


@pytest.mark.parametrize("buffer_size", [1, 5, None])
def test_files_follow_each_other_whatever_the_buffer_size(write, buffer_size):
    files = [write("a.bin", b"H" + b"aabb" + b"F"), write("b.bin", b"H" + b"cc" + b"F")]
    dataset = FixedLengthRecordDataset(files, 2, header_bytes=1, footer_bytes=1, buffer_size=buffer_size)
    assert list(dataset) == [b"aa", b"bb", b"cc"]


def test_a_gzip_file_holds_back_its_footer_until_the_stream_ends(write):
    path = write("a.bin.gz", gzip.compress(b"HH" + b"wxyz" * 100 + b"FFF"))
    dataset = FixedLengthRecordDataset(path, 4, header_bytes=2, footer_bytes=3, buffer_size=7, compression_type="GZIP")
    assert list(dataset) == [b"wxyz"] * 100


def test_a_trailing_partial_record_raises_data_loss_naming_the_file_and_its_offset(write):
    path = write("a.bin", b"HH" + b"abcd" + b"ef" + b"FFF")
    records = iter(FixedLengthRecordDataset(path, 4, header_bytes=2, footer_bytes=3))
    assert next(records) == b"abcd"
    with pytest.raises(DataLossError, match=r"a\.bin: partial record of 2 bytes.* at byte offset 6") as caught:
        next(records)
    assert (caught.value.filename, caught.value.offset) == (path, 6)
    with pytest.raises(StopIteration):
        next(records)


def test_a_file_shorter_than_its_header_raises_data_loss(write):
    with pytest.raises(DataLossError, match=r"short\.bin"):
        list(FixedLengthRecordDataset(write("short.bin", b"H"), 4, header_bytes=2))


def test_record_bytes_must_be_positive(write):
    with pytest.raises(ValueError, match="record_bytes"):
        FixedLengthRecordDataset(write("a.bin", b""), 0)


@pytest.mark.parametrize("compression_type", [None, "GZIP"])
def test_resume_mid_file_and_across_files_gives_exactly_the_remaining_records(write, check_resume, compression_type):
    compress = gzip.compress if compression_type else bytes
    files = [write("a", compress(b"HH" + b"abcdefgh" + b"F")), write("b", compress(b"HH" + b"ijkl" + b"F"))]
    dataset = FixedLengthRecordDataset(files, 2, 2, 1, buffer_size=3, compression_type=compression_type)
    assert check_resume(dataset) == [b"ab", b"cd", b"ef", b"gh", b"ij", b"kl"]
    iterator = iter(dataset)
    next(iterator)
    assert iterator.get_state() == {"file_index": 0, "offset": 4, "record_index": 1}
