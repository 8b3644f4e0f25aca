"""Counts, bandwidths and durations as people write them, and errors that name the flag and an example."""

import pytest

from shardflow.planning.units import parse_bandwidth, parse_count, parse_duration


@pytest.mark.parametrize(
    ("text", "count"), [("100M", 1e8), ("1.5B", 1.5e9), ("301k", 301e3), ("2T", 2e12), ("1e6", 1e6), ("42", 42)]
)
def test_parse_count_reads_suffixes(text, count):
    assert parse_count(text) == pytest.approx(count)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("25Gbit", 25e9 / 8),
        ("25Gbps", 25e9 / 8),
        ("25Gbit/s", 25e9 / 8),
        ("100Mb/s", 100e6 / 8),
        ("10GB/s", 10e9),
        ("5 GB/s", 5e9),
    ],
)
def test_parse_bandwidth_tells_bits_from_bytes(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "seconds"), [("120ms", 0.12), ("0.3s", 0.3), ("50us", 50e-6), ("2min", 120.0), ("1.5 ms", 1.5e-3)]
)
def test_parse_duration_reads_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("parse", "text", "words"),
    [
        (parse_count, "100X", ["--params", "100M"]),
        (parse_bandwidth, "25GB", ["--bandwidth", "10GB/s"]),
        (parse_bandwidth, "fast", ["--bandwidth", "25Gbit"]),
        (parse_duration, "120", ["--step-compute", "120ms"]),
        (parse_duration, "0ms", ["--step-compute", "positive"]),
    ],
)
def test_a_bad_quantity_names_the_flag_and_an_example(parse, text, words):
    with pytest.raises(ValueError) as error:
        parse(text)
    assert all(word in str(error.value) for word in words), str(error.value)
