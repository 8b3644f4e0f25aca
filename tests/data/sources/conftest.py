"""Helpers for the file-source tests: write small files, and check resuming from every position."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardflow.data.dataset import Dataset


def resume_everywhere(dataset: Dataset[Any], same_elements: Callable[[list[Any], list[Any]], None]) -> list[Any]:
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
        same_elements(head + list(resumed), full)
    return full


@pytest.fixture
def check_resume(same_elements: Callable[[list[Any], list[Any]], None]) -> Callable[[Dataset[Any]], list[Any]]:
    return lambda dataset: resume_everywhere(dataset, same_elements)


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, bytes], str]:
    """write(name, content) -> path of a new file under the test's tmp_path."""

    def write_file(name: str, content: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)

    return write_file
