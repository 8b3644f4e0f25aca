"""docs/tfdata.md's porting table holds the `tf.*` names a port meets first, and every shardflow (and numpy) name it
gives for them exists. Its program runs with the other docs' programs (test_readme.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow import data

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tfdata.md"
HEADING = "## Porting: the names around tf.data"
MODULES = {"data": data, "shardflow": shardflow, "np": np}
"""What the table's names start with: `from shardflow import data`, the package, numpy."""


def porting_rows() -> list[tuple[str, str]]:
    """(TensorFlow cell, shardflow cell) of each row of the porting table."""
    section = PAGE.read_text().partition(HEADING)[2].partition("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [(row[0].removeprefix("| "), row[1]) for row in rows]


def named(cell: str) -> list[str]:
    """The dotted names under `data.`, `shardflow.` and `np.` in the cell's code spans."""
    spans = re.findall(r"`([^`]+)`", cell)
    return [name for span in spans for name in re.findall(r"\b(?:data|shardflow|np)(?:\.\w+)+", span)]


NAMES = sorted({name for _, cell in porting_rows() for name in named(cell)})


def test_the_porting_table_covers_the_names_a_port_meets_first():
    tensorflow = " ".join(cell for cell, _ in porting_rows())
    for name in (
        "tf.io.FixedLenFeature",
        "tf.io.VarLenFeature",
        "tf.int64",
        "tf.float32",
        "tf.string",
        "tf.cast",
        "tf.data.AUTOTUNE",
        "tf.io.parse_example",
        "tf.data.TFRecordDataset",
        "tf.data.experimental.make_csv_dataset",
        "tf.data.Options",
    ):
        assert name in tensorflow, f"docs/tfdata.md's porting table has no row for {name}"


@pytest.mark.parametrize("name", NAMES)
def test_every_name_the_porting_table_gives_exists(name: str):
    first, *attributes = name.split(".")
    value = MODULES[first]
    for attribute in attributes:
        assert hasattr(value, attribute), f"docs/tfdata.md names {name}, but {attribute!r} is not there"
        value = getattr(value, attribute)
