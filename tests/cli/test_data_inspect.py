"""`shardflow data inspect`: record counts, CRC verification and the inferred Example schema."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from shardflow.cli.main import main

# Written by TensorFlow 2.21 (tf.io.TFRecordWriter): 5 Examples with "x" (1 to 3 floats), "label" (one int64)
# and "id" (one bytes).
TF_WRITTEN = Path(__file__).parent / "fixtures" / "tf_examples.tfrecord"


def inspect(capsys, *files: Path | str) -> tuple[int, str]:
    code = main(["data", "inspect", *map(str, files)])
    return code, capsys.readouterr().out


def test_a_tensorflow_written_file_shows_its_record_count_and_example_schema(capsys):
    code, out = inspect(capsys, TF_WRITTEN)
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows[str(TF_WRITTEN)] == ["5", "none", "ok"]
    assert rows["x"] == ["float", "5", "1", "3"]
    assert rows["label"] == ["int64", "5", "1", "1"]
    assert rows["id"] == ["bytes", "5", "1", "1"]


def test_gzip_files_are_recognized(capsys, tmp_path):
    compressed = tmp_path / "examples.tfrecord.gz"
    compressed.write_bytes(gzip.compress(TF_WRITTEN.read_bytes()))
    code, out = inspect(capsys, compressed)
    row = next(line for line in out.splitlines() if line.startswith(str(compressed)))
    assert code == 0 and row.split()[1:] == ["5", "GZIP", "ok"]


def test_a_corrupt_file_exits_non_zero_naming_the_file_and_the_offset_of_the_bad_record(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.tfrecord"
    shutil.copy(TF_WRITTEN, corrupt)
    content = bytearray(corrupt.read_bytes())
    second_record = 16 + int.from_bytes(content[:8], "little")
    content[second_record + 14] ^= 0xFF  # a byte of the second record's data
    corrupt.write_bytes(content)
    code, out = inspect(capsys, TF_WRITTEN, corrupt)
    assert code == 1
    assert f"corrupt.tfrecord: record 1: corrupted data (CRC mismatch) at byte offset {second_record}" in out


def test_a_missing_file_exits_non_zero_naming_it(capsys, tmp_path):
    code, out = inspect(capsys, tmp_path / "absent.tfrecord")
    assert code == 1 and "absent.tfrecord" in out
