"""What a role's trace of a window holds besides the window's spans: arrows into it from earlier pushes, each
counter's value at its start, and op-level events clipped to its time."""

from synthetic import FakeTime, fake_time, flow, record

from shardflow.profile.merge import merge
from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.spans import APPLY, PUSH, STEP


def on(clock: FakeTime, role: str) -> SpanRecorder:
    """A recorder whose clock is `clock`, its time 0 at the clock's 0."""
    with fake_time(clock):
        return SpanRecorder(role)


def test_a_push_from_before_the_window_is_kept_when_its_apply_lies_inside():
    clock = FakeTime()
    recorder, ps = on(clock, "worker:0"), on(clock, "ps:0")
    # The worker computed step 8 and step 10; async, the PS applied the step-8 push as global step 10 and the
    # step-10 push after the window.
    for step, start, flow_id in ((8, 0.0, 1), (10, 100.0, 2)):
        record(recorder, clock, STEP, step, start, 50.0)
        record(recorder, clock, PUSH, step, start + 30, 10.0)
        flow(recorder, clock, PUSH, step, start + 31, flow_id, start=True)
    record(ps, clock, APPLY, 10, 45.0, 20.0)
    flow(ps, clock, APPLY, 10, 46.0, 1, start=False)
    record(ps, clock, APPLY, 12, 145.0, 20.0)
    flow(ps, clock, APPLY, 12, 146.0, 2, start=False)
    trace = merge([recorder.to_role_trace(10, 11, 0.0, 0.0), ps.to_role_trace(10, 11, 0.0, 0.0)])
    kept = sorted((e["ph"], e["name"], e["args"]["step"]) for e in trace["traceEvents"] if e["ph"] in "Xsf")
    assert kept == [("X", APPLY, 10), ("X", PUSH, 8), ("X", PUSH, 10), ("X", STEP, 10), ("f", PUSH, 10), ("s", PUSH, 8)]
    assert all("lead_in" not in e.get("args", {}) for e in trace["traceEvents"])


def test_a_worker_starved_through_the_window_shows_its_earlier_push_with_its_step_and_no_counters():
    clock = FakeTime()
    worker, ps = on(clock, "worker:0"), on(clock, "ps:0")
    with fake_time(clock):
        worker.counter("memory.rss", 1e6)
    # The worker pushed at step 8, then ran no step of the window [10, 11) while the PS applied that push as step 10.
    record(worker, clock, STEP, 8, 0.0, 50.0)
    record(worker, clock, PUSH, 8, 30.0, 10.0)
    flow(worker, clock, PUSH, 8, 31.0, 1, start=True)
    record(ps, clock, APPLY, 10, 45.0, 20.0)
    flow(ps, clock, APPLY, 10, 46.0, 1, start=False)
    trace = merge([worker.to_role_trace(10, 11, 0.0, 0.0), ps.to_role_trace(10, 11, 0.0, 0.0)])
    shown = sorted((e["ph"], e["name"], e["args"].get("step")) for e in trace["traceEvents"] if e["pid"] == 1)
    assert [event for event in shown if event[0] != "M"] == [("X", PUSH, 8), ("s", PUSH, 8)]


def test_a_push_from_before_the_window_whose_apply_is_outside_is_dropped():
    clock = FakeTime()
    recorder = on(clock, "worker:0")
    record(recorder, clock, PUSH, 8, 0.0, 10.0)
    flow(recorder, clock, PUSH, 8, 1.0, 1, start=True)
    record(recorder, clock, STEP, 10, 100.0, 50.0)
    trace = merge([recorder.to_role_trace(10, 11, 0.0, 0.0)])
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] != "M"] == [STEP]


def test_an_arrow_is_stamped_where_it_was_sent_not_where_its_id_became_known():
    clock = FakeTime()
    recorder = on(clock, "worker:0")
    with fake_time(clock):
        clock.now_ns = 5_000
        sent = clock.perf_counter_ns()
        clock.now_ns = 9_000
        recorder.flow(PUSH, 0, 77, start=True, at_ns=sent)
    (arrow,) = recorder.events(0, 1)
    assert arrow["ts"] == 5.0


def test_each_counter_enters_the_window_with_the_value_it_held_at_its_start():
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("worker:0")
        for at_ns, value in ((1_000, 10.0), (2_000, 20.0), (50_000, 30.0)):
            clock.now_ns = at_ns
            recorder.counter("memory.rss", value)
    record(recorder, clock, STEP, 0, 40.0, 20.0)
    counters = [(e["ts"], e["args"]["value"]) for e in recorder.events(0, 1) if e["ph"] == "C"]
    assert counters == [(40.0, 20.0), (50.0, 30.0)]


def test_op_events_outside_the_windows_spans_are_left_out():
    clock = FakeTime()
    recorder = on(clock, "ps:0")
    record(recorder, clock, APPLY, 5, 100.0, 50.0)
    ops = [
        {"ph": "X", "name": name, "cat": "op", "ts": ts, "dur": 10.0, "tid": 0, "args": {"step": -1}}
        for name, ts in (("before", 10.0), ("inside", 110.0), ("straddling", 145.0), ("after", 500.0))
    ]
    trace = recorder.to_role_trace(5, 6, 0.0, 0.0, extra_events=ops)
    assert [e["name"] for e in trace["traceEvents"] if e.get("cat") == "op"] == ["inside"]
