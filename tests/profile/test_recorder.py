"""SpanRecorder: the ring buffer, step windows, thread names and the exported event shapes."""

import threading

import pytest
from synthetic import FakeTime, fake_time, flow, record

from shardflow.profile.recorder import SpanRecorder, get_recorder, set_recorder


def recorded(capacity: int, num_steps: int) -> SpanRecorder:
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("worker:0", capacity=capacity)
    for step in range(num_steps):
        record(recorder, clock, "step", step, step * 100.0, 90.0)
    return recorder


def test_ring_keeps_the_newest_spans_when_it_wraps_around():
    recorder = recorded(capacity=8, num_steps=20)
    assert [e["args"]["step"] for e in recorder.events(0, 100)] == list(range(12, 20))


def test_role_trace_says_whether_the_ring_still_held_the_first_step():
    recorder = recorded(capacity=8, num_steps=20)
    assert not recorder.to_role_trace(5, 20, 0.0, 0.0)["otherData"]["roles"]["worker:0"]["complete"]
    assert recorder.to_role_trace(14, 20, 0.0, 0.0)["otherData"]["roles"]["worker:0"]["complete"]


def test_events_cover_exactly_the_requested_steps():
    recorder = recorded(capacity=64, num_steps=10)
    assert sorted({e["args"]["step"] for e in recorder.events(3, 7)}) == [3, 4, 5, 6]


def test_timestamps_are_microseconds_on_the_roles_wall_clock():
    recorder = recorded(capacity=64, num_steps=3)
    step_2 = recorder.events(2, 3)[0]
    assert (step_2["ts"], step_2["dur"]) == (200.0, 90.0)


def test_span_arguments_are_named_after_the_span():
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("worker:0")
    record(recorder, clock, "push", 4, 10.0, 5.0, arg0=1, arg1=4096)
    record(recorder, clock, "pull_wait", 4, 15.0, 5.0, arg0=1)
    push, pull_wait = recorder.events(0, 10)
    assert push["args"] == {"step": 4, "ps": 1, "bytes": 4096}
    assert pull_wait["args"] == {"step": 4, "ps": 1}


def test_threads_are_named_by_their_python_name_or_the_given_track():
    recorder = SpanRecorder("ps:0")

    def serve() -> None:
        with recorder.span("apply", 1, arg0=0, arg1=10):
            pass

    thread = threading.Thread(target=serve, name="handler")
    thread.start()
    thread.join()
    recorder.end("receive", 1, recorder.begin("receive", 1), thread="receiver")
    trace = recorder.to_role_trace(0, 2, 0.0, 0.0)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    by_name = {e["name"]: names[e["tid"]] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert by_name == {"apply": "handler", "receive": "receiver"}


def test_flows_and_counters_are_exported_with_their_window():
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("worker:0")
        clock.now_ns = 4_000
        recorder.counter("memory.rss", 1e6)  # inside step 0
        clock.now_ns = 500_000
        recorder.counter("memory.rss", 2e6)  # after the captured steps
    record(recorder, clock, "push", 0, 0.0, 10.0)
    flow(recorder, clock, "push", 0, 5.0, flow_id=77, start=True)
    phases = [(e["ph"], e.get("id"), e.get("args")) for e in recorder.events(0, 1)]
    assert phases == [("X", None, {"step": 0}), ("C", None, {"value": 1e6}), ("s", 77, {"step": 0})]


def test_capacity_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        SpanRecorder("chief", capacity=1000)


def test_process_global_recorder_round_trips():
    recorder = SpanRecorder("chief")
    set_recorder(recorder)
    try:
        assert get_recorder() is recorder
    finally:
        set_recorder(None)


def test_compute_spans_name_their_argument_cpu_ns():
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("worker:0")
    record(recorder, clock, "forward", 3, 10.0, 5.0, arg0=4200)
    (forward,) = recorder.events(0, 10)
    assert forward["args"] == {"step": 3, "cpu_ns": 4200}
