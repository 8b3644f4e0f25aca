"""Shared checks for shardflow.data tests: element-by-element equality of nested numpy elements."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def _assert_same(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), f"{where}: {actual!r} != {expected!r}"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for index, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(mine, theirs, f"{where}[{index}]")
    elif isinstance(expected, bytes):
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
    else:
        mine, theirs = np.asarray(actual), np.asarray(expected)
        assert mine.shape == theirs.shape, f"{where}: shape {mine.shape} != {theirs.shape}"
        assert mine.dtype == theirs.dtype, f"{where}: dtype {mine.dtype} != {theirs.dtype}"
        assert np.array_equal(mine, theirs), f"{where}: {mine!r} != {theirs!r}"


def assert_same_elements(actual: list[Any], expected: list[Any]) -> None:
    """Same length, and each element equal in structure, shape, dtype and values (bytes compared as bytes)."""
    for index, (mine, theirs) in enumerate(zip(actual, expected, strict=False)):
        _assert_same(mine, theirs, f"element {index}")
    assert len(actual) == len(expected), f"{len(actual)} elements, expected {len(expected)}"


@pytest.fixture
def same_elements() -> Any:
    return assert_same_elements
