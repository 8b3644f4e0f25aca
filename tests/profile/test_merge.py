"""merge and cut: a legal Chrome trace with a process per role, flows from push to apply, clocks aligned."""

import gzip
import json

import pytest
from synthetic import Cluster, FakeTime, fake_time, record

from shardflow.profile.merge import cut, merge
from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.spans import REPLY
from shardflow.profile.trace import check_legal, read_trace, write_trace

SKEWED = Cluster(num_workers=2, num_ps=2, num_steps=12, skew_us={"worker:1": 2500.0, "ps:1": -1700.0})


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    path = write_trace(merge(SKEWED.role_traces()), tmp_path_factory.mktemp("merge") / "merged.trace.json.gz")
    return path, read_trace(path)


def events_of(trace, phase, name=None):
    return [e for e in trace["traceEvents"] if e["ph"] == phase and (name is None or e["name"] == name)]


def test_merged_file_is_plain_gzipped_json_that_any_reader_parses(merged):
    path, _ = merged
    whole = json.loads(gzip.decompress(path.read_bytes()))
    assert set(whole) >= {"traceEvents", "otherData"}


def test_merged_trace_is_structurally_legal(merged):
    _, trace = merged
    assert check_legal(trace) == []


def test_one_process_per_role_sorted_chief_workers_ps(merged):
    _, trace = merged
    names = {e["pid"]: e["args"]["name"] for e in events_of(trace, "M", "process_name")}
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in events_of(trace, "M", "process_sort_index")}
    assert [names[pid] for pid in sorted(names, key=lambda pid: sort_index[pid])] == [
        "chief",
        "worker:0",
        "worker:1",
        "ps:0",
        "ps:1",
    ]


def test_threads_are_named(merged):
    _, trace = merged
    named = {(e["pid"], e["tid"]) for e in events_of(trace, "M", "thread_name")}
    assert {(e["pid"], e["tid"]) for e in events_of(trace, "X")} <= named


def test_every_push_flows_into_the_apply_that_consumed_it(merged):
    _, trace = merged
    spans = events_of(trace, "X")

    def enclosing(flow_event, name):
        return [
            s
            for s in spans
            if s["name"] == name
            and (s["pid"], s["tid"]) == (flow_event["pid"], flow_event["tid"])
            and s["ts"] <= flow_event["ts"] <= s["ts"] + s["dur"]
        ]

    starts, ends = events_of(trace, "s"), {e["id"]: e for e in events_of(trace, "f")}
    assert len(starts) == SKEWED.num_steps * SKEWED.num_ps == len(ends)
    for start in starts:
        end = ends[start["id"]]
        assert end["bp"] == "e" and end["name"] == start["name"]
        (push,) = enclosing(start, "push")
        (apply,) = enclosing(end, "apply")
        assert (push["args"]["ps"], push["args"]["step"]) == (int(apply["pid"]) - 4, apply["args"]["step"])


def test_clock_offsets_put_every_role_on_the_chiefs_clock(merged):
    _, trace = merged
    pids = {e["args"]["name"]: e["pid"] for e in events_of(trace, "M", "process_name")}
    # In the simulation, each apply starts no earlier than the push that fed it ended (true time).
    for start in events_of(trace, "s"):
        end = next(e for e in events_of(trace, "f") if e["id"] == start["id"])
        assert end["ts"] - start["ts"] >= SKEWED.push_us / 2 + 5 - 1e-6
    worker_1_first_step = min(e["ts"] for e in events_of(trace, "X", "step") if e["pid"] == pids["worker:1"])
    worker_0_first_step = min(e["ts"] for e in events_of(trace, "X", "step") if e["pid"] == pids["worker:0"])
    assert worker_1_first_step == worker_0_first_step  # both start at true time 0 despite a 2.5 ms skew


def test_metadata_keeps_each_roles_offset_and_error_bound(merged):
    _, trace = merged
    roles = trace["otherData"]["roles"]
    assert (roles["worker:1"]["clock_offset_us"], roles["worker:1"]["clock_error_us"]) == (-2500.0, 5.0)
    assert roles["ps:1"]["clock_offset_us"] == 1700.0


def test_spans_that_overlap_without_nesting_move_to_an_extra_lane():
    clock = FakeTime()
    with fake_time(clock):
        recorder = SpanRecorder("ps:0")
    record(recorder, clock, REPLY, 0, 0, 100, thread="sender")
    record(recorder, clock, REPLY, 1, 50, 100, thread="sender")
    merged_trace = merge([recorder.to_role_trace(0, 2, 0.0, 5.0)])
    lanes = [e["args"]["name"] for e in events_of(merged_trace, "M", "thread_name")]
    assert sorted(lanes) == ["sender", "sender (2)"] and check_legal(merged_trace) == []


def test_cut_keeps_exactly_the_steps_of_the_window(merged, tmp_path):
    path, _ = merged
    window = read_trace(cut(path, 3, 6, tmp_path / "cut.trace.json.gz"))
    assert {e["args"]["step"] for e in window["traceEvents"] if e["ph"] in "Xsf"} == {3, 4, 5}
    assert check_legal(window) == []
    assert all(r["first_step"] == 3 and r["last_step"] == 6 for r in window["otherData"]["roles"].values())
