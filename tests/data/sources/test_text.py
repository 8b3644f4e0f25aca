"""TextLineDataset: line endings, header lines, compression, filename forms, errors and exact resume."""

from __future__ import annotations

import gzip
import zlib

import numpy as np
import pytest

from shardflow.data.sources import DataLossError, TextLineDataset


def test_lines_lose_their_newlines_and_crlf_and_a_last_line_without_newline_is_kept(write):
    path = write("a.txt", b"first\r\nsecond\n\nfourth\r\nlast")
    assert list(TextLineDataset(path)) == [b"first", b"second", b"", b"fourth", b"last"]


def test_a_file_ending_in_a_newline_has_no_empty_last_line_and_an_empty_file_no_lines(write):
    assert list(TextLineDataset([write("a.txt", b"x\ny\n"), write("b.txt", b"")])) == [b"x", b"y"]


@pytest.mark.parametrize("buffer_size", [1, 3, None])
def test_files_are_read_one_after_the_other_whatever_the_buffer_size(write, buffer_size):
    files = [write("a.txt", b"a1\na2\n"), write("b.txt", b"b1\r\nb2")]
    assert list(TextLineDataset(files, buffer_size=buffer_size)) == [b"a1", b"a2", b"b1", b"b2"]


def test_skip_header_lines_drops_the_first_lines_of_every_file(write):
    files = [write("a.txt", b"h1\nh2\na\n"), write("b.txt", b"h1\nh2\nb\n"), write("c.txt", b"h1\n")]
    assert list(TextLineDataset(files, skip_header_lines=2, buffer_size=2)) == [b"a", b"b"]


@pytest.mark.parametrize(
    ("compression_type", "compress"),
    [("GZIP", gzip.compress), ("ZLIB", zlib.compress), ("", lambda data: data), (None, lambda data: data)],
)
def test_compressed_files_read_like_plain_ones(write, compression_type, compress):
    path = write("a.txt.z", compress(b"one\r\ntwo\nthree"))
    assert list(TextLineDataset(path, compression_type=compression_type)) == [b"one", b"two", b"three"]


def test_filenames_may_be_bytes_a_tuple_or_a_numpy_array(write):
    first, second = write("a.txt", b"a\n"), write("b.txt", b"b\n")
    assert list(TextLineDataset(first.encode())) == [b"a"]
    assert list(TextLineDataset((first, second))) == [b"a", b"b"]
    assert list(TextLineDataset(np.array([first.encode(), second.encode()]))) == [b"a", b"b"]
    assert list(TextLineDataset(np.array(second.encode()))) == [b"b"]


def test_a_missing_file_raises_file_not_found_naming_it_and_reading_goes_on_with_the_next(write, tmp_path):
    missing = str(tmp_path / "missing.txt")
    lines = iter(TextLineDataset([write("a.txt", b"a\n"), missing, write("c.txt", b"c\n")]))
    assert next(lines) == b"a"
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        next(lines)
    assert list(lines) == [b"c"]


def test_a_corrupt_gzip_stream_raises_data_loss_and_reading_goes_on_with_the_next_file(write):
    compressed = bytearray(gzip.compress(b"".join(b"line %d\n" % i for i in range(1000))))
    compressed[len(compressed) // 2 :] = bytes(len(compressed) - len(compressed) // 2)
    files = [write("bad.gz", bytes(compressed)), write("good.gz", gzip.compress(b"ok\n"))]
    lines = iter(TextLineDataset(files, compression_type="GZIP", buffer_size=64))
    with pytest.raises(DataLossError, match=r"bad\.gz: (corrupt|truncated) compressed stream"):
        while True:
            next(lines)
    assert list(lines) == [b"ok"]


def test_an_unknown_compression_type_is_refused(write):
    with pytest.raises(ValueError, match="compression_type"):
        TextLineDataset(write("a.txt", b""), compression_type="BZIP2")


@pytest.mark.parametrize("buffer_size", [1, 4, None])
def test_resume_mid_file_and_across_files_gives_exactly_the_remaining_lines(write, check_resume, buffer_size):
    files = [write("a.txt", b"h\na\r\nb\n\nc"), write("b.txt", b"h\r\nd\n"), write("c.txt", b"h\ne\nf\n")]
    dataset = TextLineDataset(files, buffer_size=buffer_size, skip_header_lines=1)
    assert check_resume(dataset) == [b"a", b"b", b"", b"c", b"d", b"e", b"f"]


def test_resume_in_a_gzip_file_decompresses_again_and_skips_to_the_offset(write, check_resume):
    path = write("a.gz", gzip.compress(b"".join(b"line %d\n" % i for i in range(50))))
    dataset = TextLineDataset([path, path], compression_type="GZIP", buffer_size=16)
    assert check_resume(dataset) == [b"line %d" % i for i in range(50)] * 2


def test_state_is_file_index_byte_offset_and_lines_read(write):
    lines = iter(TextLineDataset([write("a.txt", b"x\nyy\n"), write("b.txt", b"header\nz\n")], skip_header_lines=1))
    assert next(lines) == b"yy"
    assert lines.get_state() == {"file_index": 0, "offset": 5, "record_index": 2}
    assert next(lines) == b"z"
    assert lines.get_state() == {"file_index": 1, "offset": 9, "record_index": 2}
