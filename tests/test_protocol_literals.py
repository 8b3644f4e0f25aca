"""Each protocol is spelled in one module: control-plane keys, PS request ops, header fields and span names appear
as literals nowhere else, and the layers import downward only (train/ has no import cycle, cluster/ never imports
ps/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, TypeGuard

import pytest

from shardflow.cluster import control_keys
from shardflow.cluster.control_keys import Key
from shardflow.profile import spans
from shardflow.train import job_keys

SRC = Path(__file__).resolve().parents[1] / "src" / "shardflow"
CONTROL_KEYS_MODULES = (SRC / "cluster" / "control_keys.py", SRC / "train" / "job_keys.py")
"""The plain keys of the cluster layer, and the job's typed keys (their value types reach into ps/)."""
PS_PROTOCOL_MODULE = SRC / "ps" / "protocol.py"
CONTROL_PROTOCOL_MODULE = SRC / "cluster" / "control.py"
"""The chief's control service has a protocol of its own (set, get, wait...), built and read only there."""
SPANS_MODULE = SRC / "profile" / "spans.py"
PROTOCOL_MODULES = (
    PS_PROTOCOL_MODULE,
    SRC / "ps" / "replies.py",
    SRC / "ps" / "fields.py",
    CONTROL_PROTOCOL_MODULE,
    SRC / "profile" / "clock.py",
)
"""Where a message's header fields are named; comm/ names only the envelope around them."""


def _key_names(module: object) -> set[str]:
    names = set()
    for name, value in vars(module).items():
        if name.isupper() and isinstance(value, str):
            names.add(value)
        elif isinstance(value, Key):
            names.add(value.name)
    return names


EXACT_KEYS = {name for module in (control_keys, job_keys) for name in _key_names(module) if "/" not in name}
KEY_PREFIXES = (
    "progress/",
    "heartbeat/",
    "handover/",
    "goodbye/",
    "clip_norm/",
    "failed/",
    "preempted/",
    "capture/",
    "restore/",
    "eval/",
    "chief/clock",
    "ps/",
    "dist/",
    "allreduce/",
    "state/",
)
RECORDER_METHODS = {"end", "span", "flow"}
CONTROL_METHODS = {
    "set",
    "get",
    "get_bytes",
    "get_if_set",
    "is_set",
    "add",
    "delete",
    "wait",
    "set_within",
    "endpoint",
    "publish_endpoint",
    "put",
    "read",
    "read_if_set",
}
RAW_CONTROL_METHODS = {"set", "get", "get_bytes", "get_if_set"}


def _sources(*excluded: Path) -> list[tuple[Path, ast.Module]]:
    paths = [path for path in sorted(SRC.rglob("*.py")) if path not in excluded]
    return [(path, ast.parse(path.read_text(), str(path))) for path in paths]


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(SRC.parent)}:{getattr(node, 'lineno', '?')}"


def _literal_text(node: ast.AST) -> str | None:
    """A string constant's value, or the literal text an f-string starts with."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def _is_method_call(node: ast.AST, methods: set[str]) -> TypeGuard[Any]:
    """Whether `node` calls `something.<one of methods>(...)` with a positional argument."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in methods
        and bool(node.args)
    )


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            found.add(id(node.value))  # attribute docstrings
    return found


def test_no_control_plane_key_is_spelled_outside_its_protocol_module():
    offenders = []
    for path, tree in _sources(*CONTROL_KEYS_MODULES):
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue
            text = _literal_text(node)
            if text is None:
                continue
            if text.startswith(KEY_PREFIXES):
                offenders.append(f"{_where(path, node)} {text!r}")
        # A key without a prefix ("ready", "placement") is a plain word elsewhere: look where the control plane is used.
        for node in ast.walk(tree):
            if _is_method_call(node, CONTROL_METHODS) and _literal_text(node.args[0]) in EXACT_KEYS:
                offenders.append(f"{_where(path, node)} .{node.func.attr}({_literal_text(node.args[0])!r})")
    assert not offenders, "control-plane keys spelled outside their protocol modules:\n" + "\n".join(offenders)


def test_a_typed_key_is_put_and_read_only_with_its_type():
    # `control.set(job_keys.RECOVERY.name, ...)` would write a value its readers cannot decode.
    offenders = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if _is_method_call(node, RAW_CONTROL_METHODS):
                key = node.args[0]
                if isinstance(key, ast.Attribute) and key.attr == "name" and _is_typed_key(key.value):
                    offenders.append(f"{_where(path, node)} .{node.func.attr}({ast.unparse(key)})")
    assert not offenders, "typed keys put or read as raw bytes (use put/read):\n" + "\n".join(offenders)


def _is_typed_key(node: ast.AST) -> bool:
    """`job_keys.RECOVERY`, `RECOVERY`, `job_keys.progress(name)`."""
    if isinstance(node, ast.Call):
        node = node.func
    text = ast.unparse(node)
    return text.startswith("job_keys.") or text.rpartition(".")[2].isupper()


def test_header_fields_are_read_only_in_the_protocol_modules():
    """After decoding, a message travels typed: no one reads `header["field"]` or `header.get("field")` again.
    comm/ reads the envelope (op, sender, sequence number) around every message."""
    offenders = []
    for path, tree in _sources(*PROTOCOL_MODULES):
        if SRC / "comm" in path.parents:
            continue
        for node in ast.walk(tree):
            target, field = None, None
            if isinstance(node, ast.Subscript):
                target, field = node.value, _literal_text(node.slice)
            elif _is_method_call(node, {"get", "pop"}):
                target, field = node.func.value, _literal_text(node.args[0])
            if field is not None and _names_a_header(target):
                offenders.append(f"{_where(path, node)} reads header field {field!r}")
    assert not offenders, "header fields read outside the protocol modules:\n" + "\n".join(offenders)


def _names_a_header(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Name):
        return "header" in node.id
    if isinstance(node, ast.Attribute):
        return "header" in node.attr
    return False


def test_no_ps_request_is_built_outside_the_ps_protocol_module():
    # comm/ carries an `op` field without knowing any op; in data/ and profile/ an op is a torch op.
    talk_to_the_ps = [SRC / name for name in ("ps", "train", "cluster", "cli", "tools")]
    offenders = []
    for path, tree in _sources(PS_PROTOCOL_MODULE, CONTROL_PROTOCOL_MODULE):
        if not any(package in path.parents for package in talk_to_the_ps):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = [_literal_text(key) for key in node.keys if key is not None]
                if "op" in keys:
                    offenders.append(_where(path, node))
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "op":
                offenders.append(_where(path, node))
    assert not offenders, "PS requests built or matched outside ps/protocol.py:\n" + "\n".join(offenders)


def test_no_span_name_is_spelled_outside_the_spans_module():
    names = set(spans.ALL)
    offenders = []
    for path, tree in _sources(SPANS_MODULE):
        for node in ast.walk(tree):
            if _is_method_call(node, RECORDER_METHODS) and _literal_text(node.args[0]) in names:
                offenders.append(f"{_where(path, node)} recorder.{node.func.attr}({_literal_text(node.args[0])!r})")
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    elements = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                    for element in elements:
                        if isinstance(element, ast.Constant) and element.value in names and _compares_a_name(node):
                            offenders.append(f"{_where(path, node)} compares with {element.value!r}")
            if isinstance(node, ast.Dict):
                span_keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
                if len(span_keys) >= 3:
                    offenders.append(f"{_where(path, node)} maps span names {span_keys}")
    assert not offenders, "span names spelled outside profile/spans.py:\n" + "\n".join(offenders)


def _compares_a_name(node: ast.Compare) -> bool:
    """Whether a comparison reads an event's or span's name (`e["name"] == ...`, `name in (...)`)."""
    for side in [node.left, *node.comparators]:
        if isinstance(side, ast.Subscript) and _literal_text(side.slice) == "name":
            return True
        if isinstance(side, ast.Name) and side.id in ("name", "span", "span_name"):
            return True
        if isinstance(side, ast.Attribute) and side.attr in ("name", "span_name"):
            return True
    return False


def _imports(path: Path, package: str) -> set[str]:
    """Modules of `package` that `path` imports, TYPE_CHECKING imports included."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == package:
                found.update(f"{package}.{alias.name}" for alias in node.names)
            elif node.module.startswith(package + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(package + "."))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_train_package_has_no_import_cycle():
    modules = {_module_name(path): path for path in (SRC / "train").glob("*.py")}
    graph = {name: _imports(path, "shardflow.train") & set(modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for imported in sorted(graph[name]):
            if state.get(imported) == 1:
                cycle = [*path[path.index(imported) :], imported]
                pytest.fail("import cycle in train/: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, [*path, imported])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("package", ["data", "profile", "comm", "cluster"])
def test_lower_layers_never_import_the_training_runtime(package):
    offenders = [
        f"{path.relative_to(SRC.parent)} imports {module}"
        for path in sorted((SRC / package).rglob("*.py"))
        for module in _imports(path, "shardflow")
        if module.startswith(("shardflow.train", "shardflow.ps"))
    ]
    assert not offenders, "\n".join(offenders)


def test_shardflow_environment_variables_are_named_only_in_the_env_module():
    offenders = []
    for path, tree in _sources(SRC / "env.py"):
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            text = _literal_text(node)
            # Help texts may mention a variable; a literal that is one (or starts one, "SHARDFLOW_X=...") may not.
            if id(node) not in docstrings and text is not None and re.match(r"SHARDFLOW_[A-Z_]+\b", text):
                offenders.append(f"{_where(path, node)} {text!r}")
    assert not offenders, "SHARDFLOW_* variables named outside shardflow/env.py:\n" + "\n".join(offenders)
