"""TFRecordDataset and TFRecordWriter: round trips, CRC checks, corrupt and truncated files, exact resume."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from shardflow.data.sources import DataLossError, TFRecordDataset, TFRecordOptions, TFRecordWriter
from shardflow.data.sources.tfrecord import _record_ends
from shardflow.data.sources.tfrecord_crc import all_intact, first_corrupt, masked_crc32c

# Sizes around the chunk size used below (7 bytes) and far over it, and an empty record.
RECORDS = [b"", b"a", b"hello world", bytes(range(256)) * 40, b"x" * 7]


def write_records(path, records, options=None):
    with TFRecordWriter(str(path), options) as writer:
        for record in records:
            writer.write(record)
    return str(path)


@pytest.mark.parametrize("compression_type", [None, "", "GZIP", "ZLIB"])
@pytest.mark.parametrize("buffer_size", [7, None])
def test_what_the_writer_writes_the_dataset_reads_back(tmp_path, compression_type, buffer_size):
    path = write_records(tmp_path / "a.tfrecord", RECORDS, compression_type)
    assert list(TFRecordDataset(path, compression_type, buffer_size=buffer_size)) == RECORDS


def test_options_carry_the_compression_type_and_level(tmp_path):
    options = TFRecordOptions(compression_type="GZIP", compression_level=9)
    path = write_records(tmp_path / "a.tfrecord", RECORDS, options)
    assert list(TFRecordDataset(path, "GZIP")) == RECORDS
    with pytest.raises(ValueError, match="compression_level"):
        TFRecordOptions(compression_level=11)


def test_a_record_is_framed_with_its_length_and_both_masked_crcs(tmp_path):
    path = write_records(tmp_path / "a.tfrecord", [b"abc"])
    length = struct.pack("<Q", 3)
    crcs = struct.pack("<I", masked_crc32c(length)), struct.pack("<I", masked_crc32c(b"abc"))
    assert Path(path).read_bytes() == length + crcs[0] + b"abc" + crcs[1]


def test_files_are_read_in_order(tmp_path):
    first = write_records(tmp_path / "a.tfrecord", [b"a0", b"a1"])
    second = write_records(tmp_path / "b.tfrecord", [b"b0"])
    assert list(TFRecordDataset([first, second])) == [b"a0", b"a1", b"b0"]


@pytest.mark.parametrize(
    ("flipped_byte", "problem"),
    [(16 + 3 + 2, "corrupted length"), (16 + 3 + 12 + 1, "corrupted data")],
)
def test_a_flipped_byte_raises_data_loss_naming_the_file_and_the_bad_records_offset(tmp_path, flipped_byte, problem):
    path = write_records(tmp_path / "bad.tfrecord", [b"abc", b"defgh", b"ij"])
    content = bytearray(Path(path).read_bytes())
    content[flipped_byte] ^= 0x01
    Path(path).write_bytes(content)
    records = iter(TFRecordDataset(path, buffer_size=7))
    assert next(records) == b"abc"
    with pytest.raises(DataLossError, match=rf"bad\.tfrecord: record 1: {problem}.* at byte offset 19") as caught:
        next(records)
    assert (caught.value.filename, caught.value.offset) == (path, 19)


def test_a_truncated_file_raises_data_loss_at_the_offset_of_the_cut_record(tmp_path):
    path = write_records(tmp_path / "cut.tfrecord", [b"abc", b"defgh"])
    content = Path(path).read_bytes()
    for cut in (1, 4 + 5, 16 + 5 - 1):
        Path(path).write_bytes(content[: len(content) - cut])
        records = iter(TFRecordDataset(path))
        assert next(records) == b"abc"
        with pytest.raises(DataLossError, match=r"cut\.tfrecord: truncated record 1.* at byte offset 19"):
            next(records)


def test_after_data_loss_the_rest_of_the_file_is_given_up_and_reading_goes_on_with_the_next(tmp_path):
    bad = write_records(tmp_path / "bad.tfrecord", [b"abc", b"def"])
    Path(bad).write_bytes(b"\xff" + Path(bad).read_bytes()[1:])  # the first length no longer matches its CRC
    good = write_records(tmp_path / "good.tfrecord", [b"ok"])
    records = iter(TFRecordDataset([bad, good]))
    with pytest.raises(DataLossError, match="at byte offset 0"):
        next(records)
    state = records.get_state()
    assert state == {"file_index": 1}
    assert list(records) == [b"ok"]
    resumed = iter(TFRecordDataset([bad, good]))
    resumed.set_state(state)
    assert list(resumed) == [b"ok"]


def test_a_missing_file_raises_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.tfrecord"):
        list(TFRecordDataset(str(tmp_path / "nothing.tfrecord")))


@pytest.mark.parametrize("compression_type", [None, "GZIP"])
def test_resume_mid_file_and_across_files_gives_exactly_the_remaining_records(tmp_path, check_resume, compression_type):
    files = [
        write_records(tmp_path / "a.tfrecord", RECORDS, compression_type),
        write_records(tmp_path / "b.tfrecord", [], compression_type),
        write_records(tmp_path / "c.tfrecord", [b"c0", b"c1"], compression_type),
    ]
    dataset = TFRecordDataset(files, compression_type, buffer_size=7)
    assert check_resume(dataset) == [*RECORDS, b"c0", b"c1"]


def test_state_is_file_index_byte_offset_and_records_read(tmp_path):
    files = [write_records(tmp_path / "a.tfrecord", [b"abc", b"d"]), write_records(tmp_path / "b.tfrecord", [b"e"])]
    records = iter(TFRecordDataset(files))
    next(records)
    assert records.get_state() == {"file_index": 0, "offset": 19, "record_index": 1}
    next(records), next(records)
    assert records.get_state() == {"file_index": 1, "offset": 17, "record_index": 1}


def test_file_sharding_gives_each_worker_every_nth_file(tmp_path):
    files = [write_records(tmp_path / f"{index}.tfrecord", [b"%d" % index]) for index in range(5)]
    dataset = TFRecordDataset(files)
    assert list(dataset._shard_files(2, 1)) == [b"1", b"3"]
    with pytest.raises(ValueError, match="at least one file per worker"):
        dataset._shard_files(6, 0)


def test_the_chunk_check_agrees_with_each_records_crcs_for_every_flipped_bit(tmp_path):
    path = write_records(tmp_path / "a.tfrecord", [b"abc", b"", b"defgh" * 7, b"i"])
    content = Path(path).read_bytes()
    ends = np.array(_record_ends(content), dtype=np.int64)
    starts = [0, *ends[:-1].tolist()]
    assert all_intact(content, ends)
    for bit in range(len(content) * 8):
        flipped = bytearray(content)
        flipped[bit // 8] ^= 1 << (bit % 8)
        flipped_ends = _record_ends(bytes(flipped))
        if flipped_ends != ends.tolist():
            continue  # a flipped length frames other records; the reader reports the length's CRC
        assert not all_intact(bytes(flipped), ends), f"bit {bit}"
        first_corrupt(bytes(flipped), starts, ends.tolist())  # raises AssertionError if no record is bad


def test_a_corrupt_record_after_many_intact_ones_is_named_with_its_offset(tmp_path):
    records = [b"r%d" % index for index in range(500)]
    path = write_records(tmp_path / "many.tfrecord", records)
    content = bytearray(Path(path).read_bytes())
    offset = sum(16 + len(record) for record in records[:321])
    content[offset + 12] ^= 0x40
    Path(path).write_bytes(content)
    read = iter(TFRecordDataset(path))
    assert [next(read) for _ in range(321)] == records[:321]
    with pytest.raises(DataLossError, match=rf"record 321: corrupted data .* at byte offset {offset}"):
        next(read)
