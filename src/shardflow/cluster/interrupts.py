"""SIGINT and SIGTERM as an exception in the main thread of `shardflow launch` (cluster/launcher.py run_local), and
putting the handlers back."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
_Handlers = dict[signal.Signals, _Handler]


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def install_interrupt_handlers() -> _Handlers:
    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may set handlers; the caller handles its own signals
    return {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}


def ignore_interrupts(previous: _Handlers) -> None:
    # A second Ctrl-C must not cut stop() short and leave tasks behind; stop() is bounded anyway.
    for signum in previous:
        signal.signal(signum, signal.SIG_IGN)


def restore_handlers(previous: _Handlers) -> None:
    for signum, handler in previous.items():
        # None means it was set outside Python and cannot be put back.
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)
