"""Typed decoding with msgspec, safe from any thread.

msgspec builds what it needs to decode a Struct type (its fields' types, read from the class's annotations) the
first time the type is decoded, and keeps it on the class. Two threads doing that at once for the same type can
crash the process: msgspec 0.22.0 segfaults while it evaluates the annotations (seen with two PS serving in one
process, both decoding their first request of a kind). `prepared(type_)` builds it once per type, under a lock,
before msgspec's own functions use the type; every typed decode in shardflow passes its type through it
(tests/test_structs.py checks that none goes around it).
"""

from __future__ import annotations

import threading
from typing import TypeVar

import msgspec

T = TypeVar("T")

_PREPARED: set[object] = set()
_LOCK = threading.Lock()


def prepared(type_: T) -> T:
    """`type_`, its decoding info built (once, in one thread at a time); a set lookup after the first call."""
    if type_ not in _PREPARED:
        with _LOCK:
            if type_ not in _PREPARED:
                msgspec.msgpack.Decoder(type_)  # builds and keeps the info of every Struct type within
                _PREPARED.add(type_)
    return type_
