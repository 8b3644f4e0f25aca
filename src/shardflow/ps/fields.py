"""The base of every PS message, request (ps/protocol.py) or reply (ps/replies.py): a frozen msgspec Struct that
is its own header, converted from a received header with its field types and ranges checked (a bool is never an
int), and whose errors name the op, the field and the sender."""

from __future__ import annotations

from typing import Annotated, Any, Self

import msgspec

from shardflow.comm.envelope import explain, message_fields, short
from shardflow.structs import prepared

MAX_INT = 2**63 - 1
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
"""A step, an index or a count: an int >= 0 that fits an int64."""


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
        body = message_fields(header)
        body.pop("op", None)
        try:
            return msgspec.convert(body, prepared(cls), strict=True)
        except msgspec.ValidationError as error:
            field, problem = explain(error, body, cls)
            raise PSProtocolError(op, field, sender, problem) from None
