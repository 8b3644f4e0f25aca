"""estimate_offset against a fake remote clock with a known skew and random network delays."""

import random

import pytest

from shardflow.profile.clock import estimate_offset, replied_time_ns, time_reply


def fake_ping(skew_ns: int, delays, seed: int):
    """A ping whose remote clock runs skew_ns ahead; delays(rng) gives the (outbound, inbound) delays in ns."""
    rng = random.Random(seed)
    local = [1_000_000_000]

    def ping() -> tuple[int, int, int]:
        outbound, inbound = delays(rng)
        t0 = local[0]
        t_remote = t0 + outbound + skew_ns
        t1 = t0 + outbound + rng.randrange(0, 5_000) + inbound  # the remote takes a while to answer
        local[0] = t1 + rng.randrange(10_000, 100_000)
        return t0, t_remote + (t1 - t0 - outbound - inbound), t1

    return ping


@pytest.mark.parametrize("skew_ns", [0, 3_000_000, -250_000_000, 7_777_777_777])
@pytest.mark.parametrize(
    "delays",
    [
        lambda rng: (d := rng.randrange(20_000, 80_000), d),  # symmetric
        lambda rng: (rng.randrange(5_000, 20_000), rng.randrange(50_000, 400_000)),  # slow way back
        lambda rng: (rng.randrange(100_000, 900_000), rng.randrange(1_000, 10_000)),  # slow way out
    ],
    ids=["symmetric", "asymmetric-in", "asymmetric-out"],
)
@pytest.mark.parametrize("seed", range(5))
def test_estimated_offset_is_within_its_error_bound(skew_ns, delays, seed):
    estimate = estimate_offset(fake_ping(skew_ns, delays, seed), samples=16)
    assert abs(estimate.offset_ns - skew_ns) <= estimate.error_ns


def test_symmetric_delays_give_the_exact_offset_and_keep_the_fastest_sample():
    samples = iter([(0, 1_050, 100), (1_000, 2_010, 1_020), (5_000, 5_600, 5_200)])
    estimate = estimate_offset(lambda: next(samples), samples=3)
    assert (estimate.offset_ns, estimate.error_ns, estimate.rtt_ns) == (1_000, 10, 20)


def test_a_receive_before_the_send_is_rejected():
    with pytest.raises(ValueError, match="before its send time"):
        estimate_offset(lambda: (10, 0, 5), samples=1)


def test_a_ping_answer_without_an_integer_time_names_the_field():
    assert replied_time_ns(time_reply(123)) == 123
    with pytest.raises(ValueError, match="'time_ns'"):
        replied_time_ns({"time_ns": "soon"})
