"""`shardflow data inspect`: record counts, CRC verification and the inferred Example schema."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from shardflow.cli.main import main

# Written by TensorFlow 2.21 (tf.io.TFRecordWriter): 5 Examples with "x" (1 to 3 floats), "label" (one int64)
# and "id" (one bytes).
TF_WRITTEN = Path(__file__).parent / "fixtures" / "tf_examples.tfrecord"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    # rich sizes its tables to the terminal; CI's is narrower than a developer's, and a long path would wrap.
    monkeypatch.setenv("COLUMNS", "200")


def inspect(capsys, *files: Path | str) -> tuple[int, str]:
    code = main(["data", "inspect", *map(str, files)])
    return code, capsys.readouterr().out


def test_a_tensorflow_written_file_shows_its_record_count_and_example_schema(capsys):
    code, out = inspect(capsys, TF_WRITTEN)
    assert code == 0
    file_row = next(line for line in out.splitlines() if "tf_examples" in line)
    assert "│       5 │" in file_row and "ok" in file_row
    rows = {
        line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.count("│") == 6
    }
    assert rows["x"] == ["float", "5", "1", "3"]
    assert rows["label"] == ["int64", "5", "1", "1"]
    assert rows["id"] == ["bytes", "5", "1", "1"]


def test_gzip_files_are_recognized(capsys, tmp_path):
    compressed = tmp_path / "examples.tfrecord.gz"
    compressed.write_bytes(gzip.compress(TF_WRITTEN.read_bytes()))
    code, out = inspect(capsys, compressed)
    assert code == 0 and "GZIP" in out and "│       5 │" in out


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
