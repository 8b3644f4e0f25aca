"""Clock offset between two processes from NTP-style ping exchanges, with its error bound, and the two messages
of a ping: a request with the op "time", and a reply whose "time_ns" is the answering process's `time.time_ns()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TIME_OP = "time"


@dataclass(frozen=True)
class ClockEstimate:
    offset_ns: int
    """The remote clock minus the local clock: add it to a local timestamp to get the remote clock."""
    error_ns: int
    """The true offset lies within offset_ns ± error_ns (half the round trip of the chosen sample)."""
    rtt_ns: int
    """Round trip of the chosen sample, without the time the remote took to answer."""


def estimate_offset(ping: Callable[[], tuple[int, int, int]], samples: int = 16) -> ClockEstimate:
    """Ping `samples` times and keep the exchange with the shortest round trip.

    `ping` returns (t0, t_remote, t1): the local send time, the remote's clock when it answered, and the
    local receive time, all in ns. Whatever the split of the round trip between the two directions, the
    remote read its clock between t0 and t1 local time, so the offset is t_remote - (t0 + t1) / 2 ± rtt / 2.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    best: tuple[int, int, int] | None = None
    for _ in range(samples):
        t0, t_remote, t1 = ping()
        if t1 < t0:
            raise ValueError(f"ping returned a receive time {t1} before its send time {t0}")
        if best is None or t1 - t0 < best[2] - best[0]:
            best = (t0, t_remote, t1)
    assert best is not None
    t0, t_remote, t1 = best
    rtt = t1 - t0
    return ClockEstimate(offset_ns=t_remote - (t0 + t1) // 2, error_ns=(rtt + 1) // 2, rtt_ns=rtt)


def time_request() -> dict[str, Any]:
    """The header of a ping (a new dict each time: the sender adds its envelope to it)."""
    return {"op": TIME_OP}


def time_reply(time_ns: int) -> dict[str, Any]:
    """The header of the answer to a ping: the answering process's `time.time_ns()`."""
    return {"time_ns": time_ns}


def replied_time_ns(header: dict[str, Any]) -> int:
    """The time in the answer to a ping; a ValueError names the field when it is not an integer."""
    time_ns = header.get("time_ns")
    if type(time_ns) is not int:
        raise ValueError(f"the answer to a clock ping needs an integer 'time_ns', got {time_ns!r}")
    return time_ns
