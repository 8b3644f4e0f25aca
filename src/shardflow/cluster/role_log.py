"""A role's output kept in the launcher's log directory, `<role>.log`, beside the console's copy."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType


class RoleLog:
    """Appends a role's lines to its log file. A line that cannot be written (a full or read-only disk) is lost
    alone: `say` is told once, the role's output still reaches the console, and nothing fails the launcher."""

    def __init__(self, log_dir: Path, role: str, say: Callable[[str], None]) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / f"{role.replace(':', '_')}.log"
        self.role = role
        self._say = say
        self._failed = False
        # Unbuffered: nothing is left in a buffer to fail again at close.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, line: str) -> None:
        try:
            os.write(self._fd, line.encode("utf-8"))
        except OSError as error:
            if not self._failed:
                self._say(f"cannot write {self.role}'s log {self.path}: {error}; its output still comes here")
            self._failed = True

    def __enter__(self) -> RoleLog:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        os.close(self._fd)
