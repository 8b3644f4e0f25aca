"""A role's heartbeat beats often enough for the strategy's heartbeat_timeout_s: a short timeout is not filled by
the wait between two beats."""

import time

import pytest

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.train.heartbeat import Heartbeat


def _beats_in(chief: ControlPlane, seconds: float) -> int:
    """How many distinct beats of worker:0 the chief sees in `seconds`."""
    seen, deadline = set(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(chief.get_if_set(control_keys.heartbeat("worker:0")))
        time.sleep(0.01)
    return len(seen)


@pytest.mark.parametrize(("timeout_s", "at_least", "at_most"), [(1.0, 6, 9), (10.0, 1, 3)])
def test_a_role_beats_four_times_per_heartbeat_timeout_or_once_a_second(plane, timeout_s, at_least, at_most):
    role = ControlPlane(plane.address, timeout_s=5)
    heartbeat = Heartbeat("worker:0", role, timeout_s)
    try:
        assert at_least <= _beats_in(plane, 2.0) <= at_most
    finally:
        heartbeat.stop()
        role.close()
