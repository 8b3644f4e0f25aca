"""Quantities as people write them: counts (100M, 1.5B), bandwidths (25Gbit, 10GB/s) and durations (120ms, 0.3s)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")
_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_DURATION_UNIT = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}


def parse_count(text: str, flag: str = "--params") -> float:
    """'100M' -> 1e8; suffixes k, M, B (or G) and T, case-insensitive."""
    value, unit = _split(text, flag, "100M or 1.5B")
    if unit.lower() not in _COUNT_SUFFIX:
        raise ValueError(f"{flag}: unknown suffix {unit!r} in {text!r}; use k, M, B or T, e.g. 100M or 1.5B")
    return value * _COUNT_SUFFIX[unit.lower()]


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """Bytes per second from '25Gbit' (or 25Gbps, 25Gbit/s) or '10GB/s'; decimal prefixes, as links are sold."""
    value, unit = _split(text, flag, "25Gbit or 10GB/s")
    match = re.fullmatch(r"([kKmMgGtT]?)(bit/s|bit|bps|b/s|B/s)", unit)
    if match is None:
        raise ValueError(
            f"{flag}: cannot read {text!r}; write bits as 25Gbit (or 25Gbps) and bytes as 10GB/s, e.g. 25Gbit"
        )
    prefix, kind = match.group(1).lower(), match.group(2)
    per_second = value * _PREFIX[prefix]
    return per_second if kind == "B/s" else per_second / 8


def parse_duration(text: str, flag: str = "--step-compute") -> float:
    """Seconds from '120ms', '0.3s', '50us' or '2min'."""
    value, unit = _split(text, flag, "120ms or 0.3s")
    if unit not in _DURATION_UNIT:
        raise ValueError(f"{flag}: unknown unit {unit!r} in {text!r}; use s, ms or us, e.g. 120ms or 0.3s")
    return value * _DURATION_UNIT[unit]


def format_bytes(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def format_bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s ({format_bytes(bytes_per_s)}/s)"


def _split(text: str, flag: str, example: str) -> tuple[float, str]:
    match = _NUMBER.match(text)
    if match is None:
        raise ValueError(f"{flag}: expected a number with a unit, e.g. {example}; got {text!r}")
    value = float(match.group(1))
    if value <= 0:
        raise ValueError(f"{flag}: must be positive, e.g. {example}; got {text!r}")
    return value, match.group(2)
