"""Fixtures of the launcher and zygote tests."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def role_command(request: pytest.FixtureRequest, tmp_path: Any) -> Callable[..., list[str]]:
    """A command that runs the test module's ROLE_SCRIPT with a JSON of per-role actions as its argument."""
    script = tmp_path / "role.py"
    script.write_text(request.module.ROLE_SCRIPT)

    def command(actions: dict[str, Any] | None = None) -> list[str]:
        return [sys.executable, str(script), json.dumps(actions or {})]

    return command
