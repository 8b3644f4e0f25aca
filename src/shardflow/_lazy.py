"""Attributes of a package imported on first use, so that importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, names: dict[str, str], submodules: tuple[str, ...] = ()) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `names` maps an attribute to the module that defines it, and each of
    `submodules` is an attribute that is that module itself. The value is cached in the package once imported."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(names[name])
        value = module if name in submodules else getattr(module, name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(package: str, names: dict[str, str]) -> Callable[[], list[str]]:
    """A module `__dir__` for `package` that lists its lazy attributes (`names`) beside those already loaded, so
    that `dir()` and completion show the whole public API before anything is imported."""
    namespace = sys.modules[package].__dict__

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __dir__
