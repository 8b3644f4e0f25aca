"""Optional: a value that may be absent, as tf.experimental.Optional; what `get_next_as_optional()` returns."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from shardflow.data.element_spec import spec_of
from shardflow.data.errors import InvalidArgumentError

T = TypeVar("T")

_ABSENT: Any = object()


class Optional(Generic[T]):
    """Either one element or nothing. `element_spec` is the value's spec, or the one given to `empty()`."""

    def __init__(self, value: T, element_spec: Any = None) -> None:
        self._value = value
        self._element_spec = element_spec

    @staticmethod
    def from_value(value: T) -> Optional[T]:
        return Optional(value)

    @staticmethod
    def empty(element_spec: Any = None) -> Optional[Any]:
        return Optional(_ABSENT, element_spec)

    def has_value(self) -> bool:
        return self._value is not _ABSENT

    def get_value(self) -> T:
        """The value; InvalidArgumentError if there is none, as in tf.data."""
        if self._value is _ABSENT:
            raise InvalidArgumentError("The optional does not have a value")
        return self._value

    @property
    def element_spec(self) -> Any:
        if self._value is _ABSENT:
            return self._element_spec
        return spec_of(self._value)

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self.has_value() else "Optional.empty()"
