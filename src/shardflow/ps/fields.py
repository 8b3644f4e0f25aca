"""The base of every PS message, request (ps/protocol.py) or reply (ps/replies.py): a frozen msgspec Struct that
is its own header, converted from a received header with its field types and ranges checked (a bool is never an
int), and whose errors name the op, the field and the sender."""

from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any, Self

import msgspec

ENVELOPE = ("op", "s", "q")
"""Keys comm/ sets in a request or reply header: the op name, the sender and the sequence number."""
_ENVELOPE = frozenset(ENVELOPE)
MAX_INT = 2**63 - 1
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
"""A step, an index or a count: an int >= 0 that fits an int64."""
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist, _repr.maxdict, _repr.maxlevel = 6, 4, 2
short = _repr.repr
# msgspec's errors: "<problem> - at `$.field[0]`", or "Object missing required field `field`" (or "contains unknown").
_AT = re.compile(r" - at `(key` in `)?\$(?:\.(\w+))?([^`]*)`$")
_TYPE_NAME = re.compile(r"`([^`]+)`")
_WORDS = {"int": "an int", "float": "a float", "str": "a str", "bool": "a bool", "array": "a list", "object": "a map"}
_NAMED = re.compile(r"Object (missing required|contains unknown) field `(.*)`$")


class PSProtocolError(ValueError):
    """A request or reply that breaks the PS protocol; names the op, the field and the sender."""

    def __init__(self, op: object, field: str, sender: str, problem: str) -> None:
        self.op, self.field, self.sender = op, field, sender
        super().__init__(f"{short(op)} from {sender}: {field} {problem}")


class Invalid(Exception):
    """Raised by a message's checks of what its types cannot say; decode_request adds the op and the sender."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field, self.problem = field, problem


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A PS message: its fields are its header's (a field left at its default is not sent). Each subclass says
    frozen=True again (and kw_only=True where it needs it), for mypy, which does not inherit them."""

    def header(self) -> dict[str, Any]:
        """The header to send (bytes in a field are sent as they are)."""
        header: dict[str, Any] = msgspec.to_builtins(self, builtin_types=(bytes,))
        return header

    @classmethod
    def from_header(cls, header: dict[Any, Any], op: object, sender: str) -> Self:
        """The message in a received `header`; PSProtocolError if it is not one."""
        body = {key: value for key, value in header.items() if key not in _ENVELOPE}
        try:
            return msgspec.convert(body, cls, strict=True)
        except msgspec.ValidationError as error:
            field, problem = _explain(str(error), body, cls)
            raise PSProtocolError(op, field, sender, problem) from None


def _explain(error: str, body: dict[Any, Any], message_type: type[Message]) -> tuple[str, str]:
    """The field msgspec's `error` is about, and the problem in words."""
    at = _AT.search(error)
    problem = error if at is None else error[: at.start()]
    if at is not None and at[2] is not None:
        field = at[2]
        where = " for its keys" if at[1] else f" at {field}{at[3]}" if at[3] else ""
        expected, _, got = _TYPE_NAME.sub(_in_words, problem.removeprefix("Expected ")).partition(", got ")
        if problem.startswith("Expected "):
            return field, f"must be {expected}{where}, got {got or short(body.get(field))}"
        return field, f"is not valid{where}: {problem}"
    named = _NAMED.match(problem)
    if named is not None and named[1] == "missing required":
        return named[2], "is missing"
    if named is not None:
        fields = ", ".join(message_type.__struct_fields__) or "none"
        return repr(named[2]), f"is not a field of this message (it has {fields})"
    return "header", f"is not valid: {problem}"


def _in_words(type_name: re.Match[str]) -> str:
    """msgspec's name of a type (`int | null`) in words (an int or None)."""
    return " or ".join(_WORDS.get(name, "None" if name == "null" else name) for name in type_name[1].split(" | "))
