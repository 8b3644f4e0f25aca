"""save/load/snapshot on disk: shardflow's own format, committed atomically, and damage reported by file and offset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def elements_of(path: Path) -> list[Any]:
    return list(D.load(str(path)))


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.sfdata"))


def saved(tmp_path: Path, compression: str | None = None) -> Path:
    path = tmp_path / "saved"
    D.range(6).map(lambda x: {"x": x, "vector": np.arange(x, dtype=np.float32), "text": b"t%d" % x}).save(
        str(path), compression=compression
    )
    return path


def test_a_saved_dataset_is_a_manifest_and_shard_files_of_shardflow_records(tmp_path: Path) -> None:
    path = saved(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "shardflow-saved-dataset" and manifest["compression"] is None
    assert [shard["num_elements"] for shard in manifest["shards"]] == [6]
    (shard,) = shard_files(path)
    assert shard.name == manifest["shards"][0]["file"]
    assert shard.read_bytes()[:8] == b"SFSAVED1"
    assert sorted(os.listdir(path)) == sorted(["manifest.json", shard.name])  # no temporary file left


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_a_damaged_record_is_reported_with_its_file_and_offset(tmp_path: Path, compression: str | None) -> None:
    path = saved(tmp_path, compression)
    (shard,) = shard_files(path)
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0xFF  # inside the first record, which starts right after the 8-byte magic
    shard.write_bytes(bytes(raw))
    with pytest.raises(data.DataLossError) as caught:
        elements_of(path)
    assert caught.value.filename == str(shard) and caught.value.offset == 8
    assert str(shard) in str(caught.value) and "offset 8" in str(caught.value)


def test_a_damaged_later_record_names_its_own_offset(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (shard,) = shard_files(path)
    raw = bytearray(shard.read_bytes())
    raw[-40 - 8 * 6] ^= 0xFF  # in the last record, just before the offsets table and footer
    shard.write_bytes(bytes(raw))
    iterator = iter(D.load(str(path)))
    assert [int(next(iterator)["x"]) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(data.DataLossError) as caught:
        next(iterator)
    assert 8 < caught.value.offset < len(raw) - 40 - 8 * 6


def test_a_truncated_shard_is_reported(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (shard,) = shard_files(path)
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(data.DataLossError, match="footer"):
        elements_of(path)


def test_a_damaged_manifest_is_reported(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (path / "manifest.json").write_text('{"format": "something else"')
    with pytest.raises(data.DataLossError, match="manifest"):
        D.load(str(path))


def test_load_of_a_directory_without_a_saved_dataset_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no saved dataset"):
        D.load(str(tmp_path))


def test_a_save_that_fails_midway_leaves_the_earlier_save_whole(tmp_path: Path) -> None:
    path = saved(tmp_path)
    before = sorted(os.listdir(path))

    def fails_at_three(x: Any) -> Any:
        if x == 3:
            raise RuntimeError("input broke")
        return {"x": x, "vector": np.zeros(1, dtype=np.float32), "text": b""}

    with pytest.raises(RuntimeError, match="input broke"):
        D.range(10).map(fails_at_three).save(str(path))
    assert sorted(os.listdir(path)) == before
    assert [int(element["x"]) for element in elements_of(path)] == list(range(6))


def test_load_rejects_a_compression_the_save_did_not_use(tmp_path: Path) -> None:
    path = saved(tmp_path, "GZIP")
    assert len(elements_of(path)) == 6
    with pytest.raises(ValueError, match="GZIP"):
        D.load(str(path), compression="")
    with pytest.raises(ValueError, match="compression"):
        D.range(3).save(str(tmp_path / "other"), compression="SNAPPY")


def test_save_refuses_checkpoint_args(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_args"):
        D.range(3).save(str(tmp_path / "saved"), checkpoint_args={"checkpoint_interval": 1})


def test_snapshots_of_different_pipelines_share_a_path_without_mixing(tmp_path: Path) -> None:
    evens = D.range(5).map(lambda x: x * 2).snapshot(str(tmp_path), compression="GZIP")
    odds = D.range(5).map(lambda x: x * 2 + 1).snapshot(str(tmp_path), compression="GZIP")
    for _ in range(2):  # the second time both read their snapshots
        assert [int(x) for x in evens] == [0, 2, 4, 6, 8]
        assert [int(x) for x in odds] == [1, 3, 5, 7, 9]
    assert len([entry for entry in tmp_path.iterdir() if (entry / "manifest.json").exists()]) == 2


def test_ignore_errors_skips_a_damaged_record_and_reads_the_rest(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (shard,) = shard_files(path)
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert [int(element["x"]) for element in D.load(str(path)).ignore_errors()] == [1, 2, 3, 4, 5]


SNAPSHOT_SCRIPT = """
import sys
import numpy as np
from shardflow import data

def rows(path):
    with open(path) as lines:
        for line in lines:
            yield np.int64(int(line))

dataset = data.Dataset.from_generator(rows, args=(sys.argv[1],)).map(lambda x: x * 10).snapshot(sys.argv[2])
print([int(x) for x in dataset])
"""


def test_another_process_running_the_same_pipeline_reads_the_snapshot(tmp_path: Path) -> None:
    source = tmp_path / "numbers.txt"
    source.write_text("1\n2\n3\n")
    script = tmp_path / "pipeline.py"
    script.write_text(SNAPSHOT_SCRIPT)

    def run() -> str:
        command = [sys.executable, str(script), str(source), str(tmp_path / "snap")]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    assert run() == "[10, 20, 30]"
    source.write_text("1\n2\n3\n4\n")  # the snapshot, not the file, is read from now on
    assert run() == "[10, 20, 30]"
