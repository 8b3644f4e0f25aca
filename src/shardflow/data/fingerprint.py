"""fingerprint(): a 64-bit hash of how a pipeline is built (its datasets, their arguments and their functions), the
same in every process that builds it the same way, as tf.data's Dataset.fingerprint promises."""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
import types
from typing import Any

import numpy as np

from shardflow.data.dataset import Dataset

# Bookkeeping of shardflow's datasets that does not change their elements: pass counters, locks, cached elements.
_SKIPPED_ATTRIBUTES = frozenset({"_passes", "_lock", "_memory", "_directory"})
_SKIPPED_TYPES: tuple[type, ...] = (itertools.count, type(threading.Lock()), type(threading.RLock()))


def fingerprint(dataset: Dataset[Any]) -> np.uint64:
    """Equal fingerprints mean the same elements (given the same input files and deterministic functions). Values,
    arrays, code, closures and referenced globals are hashed; an object without a readable form is hashed by its
    repr, which makes two pipelines holding different objects differ."""
    hasher = _Hasher()
    hasher.add(dataset)
    return np.uint64(int.from_bytes(hasher.digest.digest(), "little"))


class _Hasher:
    def __init__(self) -> None:
        self.digest = hashlib.blake2b(digest_size=8)
        # Objects already hashed, by id, with the objects kept alive so that an id is not reused meanwhile.
        self._seen: dict[int, tuple[int, Any]] = {}

    def _write(self, tag: str, payload: bytes = b"") -> None:
        self.digest.update(f"{tag}:{len(payload)}:".encode())
        self.digest.update(payload)

    def add(self, value: Any) -> None:
        if value is None or isinstance(value, bool | int | float | complex | str):
            self._write(type(value).__name__, repr(value).encode())
        elif isinstance(value, bytes | bytearray):
            self._write("bytes", bytes(value))
        elif isinstance(value, np.generic):
            self.add(np.asarray(value))
        elif isinstance(value, np.ndarray):
            self._write("array", f"{value.dtype.str}{value.shape}".encode())
            if value.dtype == object:
                for item in value.reshape(-1).tolist():
                    self.add(item)
            else:
                self._write("data", np.ascontiguousarray(value).tobytes())
        elif isinstance(value, types.ModuleType):
            self._write("module", value.__name__.encode())
        elif isinstance(value, _SKIPPED_TYPES):
            self._write("skipped", type(value).__qualname__.encode())
        elif id(value) in self._seen:
            self._write("reference", str(self._seen[id(value)][0]).encode())
        else:
            self._seen[id(value)] = (len(self._seen), value)
            self._add_object(value)

    def _add_object(self, value: Any) -> None:
        if isinstance(value, tuple | list):
            self._write(type(value).__qualname__, str(len(value)).encode())
            for item in value:
                self.add(item)
        elif isinstance(value, dict):
            self._write("dict", str(len(value)).encode())
            for key in sorted(value, key=repr):
                self.add(key)
                self.add(value[key])
        elif isinstance(value, set | frozenset):
            self.add(sorted(value, key=repr))
        elif isinstance(value, types.FunctionType):
            self._add_function(value)
        elif isinstance(value, types.MethodType):
            self._write("method")
            self.add(value.__func__)
            self.add(value.__self__)
        elif isinstance(value, functools.partial):
            self._write("partial")
            self.add(value.func)
            self.add(value.args)
            self.add(value.keywords)
        elif isinstance(value, types.CodeType):
            self._add_code(value)
        elif isinstance(value, type | types.BuiltinFunctionType):
            self._write("named", f"{value.__module__}.{value.__qualname__}".encode())
        elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
            self._write("object", f"{type(value).__module__}.{type(value).__qualname__}".encode())
            self.add(
                {
                    name: item
                    for name, item in _attributes(value).items()
                    if not (isinstance(value, Dataset) and name in _SKIPPED_ATTRIBUTES)
                }
            )
        else:
            self._write("repr", f"{type(value).__qualname__}:{value!r}".encode())

    def _add_function(self, function: types.FunctionType) -> None:
        self._write("function", f"{function.__module__}.{function.__qualname__}".encode())
        self.add(function.__code__)
        self.add(function.__defaults__)
        self.add(function.__kwdefaults__)
        self.add([cell.cell_contents for cell in function.__closure__ or ()])
        names = _global_names(function.__code__)
        self.add({name: function.__globals__[name] for name in sorted(names) if name in function.__globals__})

    def _add_code(self, code: types.CodeType) -> None:
        self._write("code", code.co_code)
        self.add(code.co_consts)
        self.add(code.co_names)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def _attributes(value: Any) -> dict[str, Any]:
    attributes = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(value, name) and name not in ("__dict__", "__weakref__"):
                attributes[name] = getattr(value, name)
    return attributes
