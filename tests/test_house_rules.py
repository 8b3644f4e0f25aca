"""The house rules that keep the code readable, checked on every run: no file under src/ over 500 lines, no function
over 60 lines (from its `def` to its last line). The layering of imports is checked in test_protocol_literals.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardflow"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its qualified name (Class.method, outer.inner)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((prefix + node.name, node))
            found += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, f"{prefix}{node.name}.")
        else:
            found += _functions(node, prefix)
    return found


def _long_files() -> dict[str, int]:
    lengths = {_name(path): len(path.read_text().splitlines()) for path in _sources()}
    return {name: length for name, length in lengths.items() if length > MAX_FILE_LINES}


def _long_functions() -> dict[str, int]:
    found = {}
    for path in _sources():
        for qualified_name, node in _functions(ast.parse(path.read_text(), str(path))):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found[f"{_name(path)}::{qualified_name}"] = length
    return found


def _check(found: dict[str, int], what: str, limit: str) -> None:
    lines = [f"{name}: {length} lines" for name, length in sorted(found.items())]
    assert not found, f"{what} over the house rule ({limit}); split them:\n" + "\n".join(lines)


def test_no_file_under_src_is_over_500_lines():
    _check(_long_files(), "files", f"{MAX_FILE_LINES} lines")


def test_no_function_under_src_is_over_60_lines():
    _check(_long_functions(), "functions", f"{MAX_FUNCTION_LINES} lines from def to end")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    pass\n", ["f"]),
        ("class A:\n    def m(self):\n        def inner():\n            pass\n", ["A.m", "A.m.inner"]),
        ("if True:\n    async def g():\n        pass\n", ["g"]),
    ],
)
def test_functions_are_named_as_the_allow_list_names_them(source, expected):
    assert [name for name, _ in _functions(ast.parse(source))] == expected
