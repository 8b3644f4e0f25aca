"""Helpers for the file-source tests: write small files, and check resuming from every position."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow.data.dataset import Dataset


def assert_same(actual: Any, expected: Any) -> None:
    """Equal structure, dtypes and values; dicts compared key by key."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, tuple | list):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for mine, theirs in zip(actual, expected, strict=True):
            assert_same(mine, theirs)
    elif isinstance(expected, bytes):
        assert actual == expected
    else:
        assert np.asarray(actual).dtype == np.asarray(expected).dtype
        np.testing.assert_array_equal(actual, expected)


def resume_everywhere(dataset: Dataset[Any]) -> list[Any]:
    """For every k: take k elements, save the state (through JSON), and check that a fresh iterator restored from
    it yields exactly the rest. Returns the full sequence."""
    full = list(dataset)
    for taken in range(len(full) + 1):
        iterator = iter(dataset)
        head = [next(iterator) for _ in range(taken)]
        state = json.loads(json.dumps(iterator.get_state()))
        iterator.close()
        resumed = iter(dataset)
        resumed.set_state(state)
        assert_same(head + list(resumed), full)
    return full


@pytest.fixture
def check_resume() -> Callable[[Dataset[Any]], list[Any]]:
    return resume_everywhere


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, bytes], str]:
    """write(name, content) -> path of a new file under the test's tmp_path."""

    def write_file(name: str, content: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)

    return write_file
