"""OpCapture folds torch.profiler's ops and allocations into the role trace; MemorySampler records counters."""

import threading
import time

import pytest

from shardflow.profile.memory import CPU_CORES, RSS, USABLE_CPUS_BUSY, MemorySampler
from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.torch_ops import OpCapture
from shardflow.profile.trace import check_legal

torch = pytest.importorskip("torch")


def train_steps(recorder: SpanRecorder, num_steps: int) -> None:
    model = torch.nn.Linear(16, 8)
    for step in range(num_steps):
        with recorder.span("step", step):
            with recorder.span("forward", step):
                loss = model(torch.randn(4, 16)).sum()
            with recorder.span("backward", step):
                loss.backward()


@pytest.fixture(scope="module")
def captured():
    recorder = SpanRecorder("worker:0")
    with OpCapture(recorder) as ops:
        train_steps(recorder, 3)
    return recorder, ops.events()


def test_ops_carry_shapes_source_device_and_the_step_they_ran_in(captured):
    _, events = captured
    linear = [e for e in events if e["name"] == "aten::linear"]
    assert [e["args"]["step"] for e in linear] == [0, 1, 2]
    assert linear[0]["args"]["shape"] == "[[4,16],[8,16],[8]]"
    assert linear[0]["args"]["device"] == "cpu"
    assert "test_torch_ops.py" in linear[0]["args"]["source"]


def test_ops_lie_inside_their_step_on_the_recorders_clock(captured):
    recorder, events = captured
    steps = {e["args"]["step"]: e for e in recorder.events(0, 3) if e["name"] == "step"}
    for op in (e for e in events if e["name"] == "aten::linear"):
        step = steps[op["args"]["step"]]
        assert step["ts"] - 50 <= op["ts"] <= step["ts"] + step["dur"] + 50  # two conversions to wall time


def test_allocations_name_the_op_that_made_them_and_feed_a_counter(captured):
    _, events = captured
    allocations = [e for e in events if e["ph"] == "i" and e["name"] == "alloc"]
    assert allocations and all(e["args"]["bytes"] > 0 for e in allocations)
    assert any(e["args"].get("op") for e in allocations)
    assert any(e["ph"] == "C" and e["name"] == "memory.torch_cpu_allocated" for e in events)


def test_role_trace_with_ops_is_legal_and_puts_ops_on_a_named_track(captured):
    recorder, events = captured
    trace = recorder.to_role_trace(0, 3, 0.0, 0.0, extra_events=[dict(e) for e in events])
    assert check_legal(trace) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert f"{threading.current_thread().name} ops" in names


def test_memory_sampler_records_rss_while_running():
    recorder = SpanRecorder("worker:0")
    with MemorySampler(recorder, interval_s=0.001), recorder.span("step", 0):
        time.sleep(0.02)
    counters = [e for e in recorder.events(0, 1) if e["ph"] == "C"]
    rss = [e for e in counters if e["name"] == RSS]
    assert rss and all(e["args"]["value"] > 1e6 for e in rss)
    assert {e["name"] for e in counters} == {RSS, CPU_CORES, USABLE_CPUS_BUSY}


def test_the_cpu_counter_integrates_to_the_cpu_time_used_between_samples():
    recorder = SpanRecorder("worker:0")
    sampler = MemorySampler(recorder)
    with recorder.span("step", 0):
        sampler.sample()  # the baseline: no cpu counter yet
        cpu_before = time.process_time()
        deadline = time.perf_counter() + 0.1
        while time.perf_counter() < deadline:  # busy
            pass
        sampler.sample()
        time.sleep(0.05)  # idle
        sampler.sample()
        cpu_used = time.process_time() - cpu_before
    samples = [(e["ts"], e["args"]["value"]) for e in recorder.events(0, 1) if e["name"] == CPU_CORES]
    assert len(samples) == 2
    # Each value covers the time since the sample before it: the first the busy loop, the second the sleep.
    busy_us = samples[0][0] - min(e["ts"] for e in recorder.events(0, 1) if e["name"] == RSS)
    integral = samples[0][1] * busy_us / 1e6 + samples[1][1] * (samples[1][0] - samples[0][0]) / 1e6
    assert integral == pytest.approx(cpu_used, abs=0.01)
    assert samples[1][1] < samples[0][1]  # the idle interval reads as less busy
