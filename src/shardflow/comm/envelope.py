"""The envelope of every message: the header names comm/ sets around a protocol's own fields, and the short repr
an error uses to quote what a peer sent."""

from __future__ import annotations

import re
import reprlib
from typing import Any, get_type_hints

import msgspec

OP = "op"
"""The message's kind; a protocol module's union of message types reads it as its tag."""
SENDER = "s"
SEQUENCE = "q"
ACKNOWLEDGED = "a"
"""In a request: the oldest sequence number the sender still awaits a reply to from this peer."""
RESENT = "r"
"""In a request: sent again on a new connection (comm/client.py Client._resend)."""
ENVELOPE = (OP, SENDER, SEQUENCE, ACKNOWLEDGED, RESENT)
"""Keys comm/ sets in a request or reply header: the op name, the sender, the sequence number and the two above."""

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist, _repr.maxdict, _repr.maxlevel = 6, 4, 2
short = _repr.repr
"""A peer's value quoted in an error, cut to a few dozen characters."""


def message_fields(header: dict[str, Any]) -> dict[str, Any]:
    """The header without comm/'s keys but the op: the op (a tag) and the message's own fields."""
    return {name: value for name, value in header.items() if name not in _NOT_FIELDS}


_NOT_FIELDS = frozenset((SENDER, SEQUENCE, ACKNOWLEDGED, RESENT))


# msgspec's errors: "<problem> - at `$.field[0]`", or "Object missing required field `field`" (or "contains unknown").
_AT = re.compile(r" - at `(key` in `)?\$(?:\.(\w+))?([^`]*)`$")
_TYPE_NAME = re.compile(r"`([^`]+)`")
_WORDS = {"int": "an int", "float": "a float", "str": "a str", "bool": "a bool", "array": "a list", "object": "a map"}
_NAMED = re.compile(r"Object (missing required|contains unknown) field `(.*)`$")


def explain(
    error: msgspec.ValidationError, body: dict[Any, Any], message_type: type[msgspec.Struct]
) -> tuple[str, str]:
    """The field msgspec's `error` about `body` is about, and the problem in words for a peer: "is missing", "is not a
    field of this message (it has ...)", or "must be <the field's Meta description, else its type>, got <value>"."""
    text = str(error)
    at = _AT.search(text)
    problem = text if at is None else text[: at.start()]
    if at is not None and at[2] is not None:
        field = at[2]
        got = short(body.get(field))
        rule = _described(message_type, field)
        if rule is not None:
            return field, f"must be {rule}, got {got}"
        where = " for its keys" if at[1] else f" at {field}{at[3]}" if at[3] else ""
        expected, _, named_got = _TYPE_NAME.sub(_in_words, problem.removeprefix("Expected ")).partition(", got ")
        if problem.startswith("Expected "):
            return field, f"must be {expected}{where}, got {named_got or got}"
        return field, f"is not valid{where}: {problem}"
    named = _NAMED.match(problem)
    if named is not None and named[1] == "missing required":
        return named[2], "is missing"
    if named is not None:
        fields = ", ".join(message_type.__struct_fields__) or "none"
        return repr(named[2]), f"is not a field of this message (it has {fields})"
    field, _, rest = problem.partition(" ")  # a message's own check (__post_init__) names its field first
    if field in message_type.__struct_fields__:
        return field, rest
    return "header", f"is not valid: {problem}"


def _described(message_type: type[msgspec.Struct], field: str) -> str | None:
    """The description a field's type gives itself (`Annotated[..., msgspec.Meta(description=...)]`), if any."""
    metadata = getattr(get_type_hints(message_type, include_extras=True).get(field), "__metadata__", ())
    return next((meta.description for meta in metadata if getattr(meta, "description", None)), None)


def _in_words(type_name: re.Match[str]) -> str:
    """msgspec's name of a type (`int | null`) in words (an int or None)."""
    return " or ".join(_WORDS.get(name, "None" if name == "null" else name) for name in type_name[1].split(" | "))
