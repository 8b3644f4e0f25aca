"""Analyzers on the hand-built fixture capture equal the values computed by hand in fixtures/three_roles/README.md."""

import pytest

from shardflow.profile.analysis import diff, memory, top
from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.diagnose import diagnose, steps, summarize
from shardflow.profile.events import in_steps, load, name_matches

# The merged trace counts time from the earliest role origin on the chief's clock: ps:0's, 500 µs earlier.
SHIFT = 500.0


@pytest.fixture
def table(fixture_model_dir):
    return load(finalize(capture_dir(fixture_model_dir)))


def self_times(rows):
    return {row.key: (row.calls, row.self_value) for row in rows}


def test_events_table_has_a_row_per_event_with_roles_threads_and_steps(table):
    assert table.num_rows == 3 * 21 + 3 * 5 + 4
    worker_ops = table.filter(table["thread"].to_numpy(zero_copy_only=False) == "MainThread ops")
    assert set(worker_ops["role"].to_pylist()) == {"worker:0"}
    assert sorted(set(table["step"].drop_null().to_pylist())) == [0, 1, 2]


def test_top_by_time_is_self_time_over_the_three_steps(table):
    times = self_times(top(table))
    assert times["forward"] == (3, 900.0)
    assert times["step"] == (3, 150.0)  # the idle 50 µs per step
    assert times["aten::linear"] == (3, 60.0)
    assert times["aten::addmm"] == (3, 540.0)
    assert times["apply"] == (3, 150.0)
    assert times["eval"] == (1, 200.0)


def test_hidden_entries_roll_up_into_their_nearest_shown_parent(table):
    rows = top(table, shown=name_matches(r"^aten::linear$|Backward"))
    assert self_times(rows) == {"aten::linear": (3, 600.0), "AddmmBackward0": (3, 570.0)}
    assert [row.total_value for row in rows] == [600.0, 570.0]


def test_top_groups_by_source_and_by_role(table):
    by_source = self_times(top(table, group_by="source"))
    assert by_source["model.py(12): forward"] == (6, 600.0)
    assert by_source["train.py(30): step"] == (6, 570.0)
    by_role = self_times(top(table, group_by="role"))
    assert by_role["ps:0"] == (9, 240.0)
    assert by_role["chief"] == (2, 400.0)


def test_top_respects_a_step_window(table):
    assert self_times(top(table, step_range=in_steps(1, 2)))["forward"] == (1, 300.0)


def test_top_by_memory_is_allocated_bytes_rolled_up_into_shown_parents(table):
    assert self_times(top(table, by="memory")) == {"aten::addmm": (3, 24576.0), "aten::mm": (3, 49152.0)}
    rows = top(table, by="memory", shown=name_matches("Backward|linear"))
    assert self_times(rows) == {"AddmmBackward0": (3, 49152.0), "aten::linear": (3, 24576.0)}


def test_steps_break_each_role_down_into_parts(table):
    summaries = {s.role: s for s in summarize(steps(table))}
    worker = summaries["worker:0"]
    assert (worker.num_steps, worker.step_us) == (3, 1000.0)
    assert worker.parts_us == {
        "input_wait": 200.0,
        "compute": 600.0,
        "communication": 150.0,
        "apply": 0.0,
        "other": 0.0,
        "idle": 50.0,
    }
    ps = summaries["ps:0"]
    assert (ps.step_us, ps.parts_us["communication"], ps.parts_us["apply"], ps.parts_us["idle"]) == (
        1000.0,
        30.0,
        50.0,
        920.0,
    )
    assert (summaries["chief"].num_steps, summaries["chief"].parts_us["other"]) == (2, 200.0)


def test_fixture_diagnosis_is_compute_bound(table):
    finding = diagnose(table)[0]
    assert (finding.bottleneck, finding.role, finding.fraction) == ("compute", "worker:0", 0.6)


def test_memory_peaks_say_what_ran_and_what_was_live(table):
    peaks = {(p.role, p.counter): p for p in memory(table)}
    rss = peaks[("worker:0", "memory.rss")]
    assert (rss.peak, rss.ts, rss.step, rss.active) == (152e6, 12500.0 + SHIFT, 2, ["step", "backward"])
    assert [(g.op, g.bytes) for g in rss.live] == [("aten::addmm", 8192)]
    allocated = peaks[("worker:0", "memory.torch_cpu_allocated")]
    assert (allocated.peak, allocated.ts, allocated.step) == (24576.0, 10530.0 + SHIFT, 0)
    assert [(g.op, g.shape, g.bytes) for g in allocated.live] == [
        ("aten::mm", "[[32,64],[64,64]]", 16384),
        ("aten::addmm", "[[64],[32,64],[64,64]]", 8192),
    ]
    assert (peaks[("chief", "memory.rss")].peak, peaks[("chief", "memory.rss")].active) == (60e6, ["checkpoint"])
    assert peaks[("ps:0", "memory.rss")].peak == 200e6


def test_diff_of_a_capture_with_itself_is_zero(table):
    assert all(row.delta_us == 0 for row in diff(table, table))


def test_diff_shows_a_faster_forward_as_less_compute_and_more_idle(table):
    faster = table.set_column(
        table.schema.get_field_index("dur"),
        "dur",
        [
            [
                250.0 if name == "forward" else dur
                for name, dur in zip(table["name"].to_pylist(), table["dur"].to_pylist(), strict=True)
            ]
        ],
    )
    changes = {row.key: (row.a_us, row.b_us) for row in diff(table, faster) if row.delta_us}
    assert changes == {
        "worker:0 compute": (600.0, 550.0),
        "worker:0 idle": (50.0, 100.0),
        "self forward": (300.0, 250.0),
        "self step": (50.0, 100.0),
    }
