"""ParameterServerStrategy.wire_dtype: "bf16" or None, anything else refused naming the field and the choices."""

from __future__ import annotations

import pytest

import shardflow as sf


@pytest.mark.parametrize("value", [None, "bf16"])
def test_wire_dtype_takes_bf16_or_none(value):
    assert sf.ParameterServerStrategy(wire_dtype=value).wire_dtype == value


@pytest.mark.parametrize("value", ["bfloat16", "fp16", "", 16])
def test_any_other_wire_dtype_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(ValueError, match=r"ParameterServerStrategy\.wire_dtype must be 'bf16' or None, got "):
        sf.ParameterServerStrategy(wire_dtype=value)
