"""The envelope of every message: the header names comm/ sets around a protocol's own fields, and the short repr
an error uses to quote what a peer sent."""

from __future__ import annotations

import reprlib
from typing import Any

OP = "op"
"""The message's kind; a protocol module's union of message types reads it as its tag."""
SENDER = "s"
SEQUENCE = "q"
ENVELOPE = (OP, SENDER, SEQUENCE)
"""Keys comm/ sets in a request or reply header: the op name, the sender and the sequence number."""

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist, _repr.maxdict, _repr.maxlevel = 6, 4, 2
short = _repr.repr
"""A peer's value quoted in an error, cut to a few dozen characters."""


def message_fields(header: dict[str, Any]) -> dict[str, Any]:
    """The header without the sender and the sequence number: the op (a tag) and the message's own fields."""
    return {name: value for name, value in header.items() if name != SENDER and name != SEQUENCE}
