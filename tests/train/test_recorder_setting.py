"""SHARDFLOW_RECORDER: on (the default), off, or alternate:N for measuring what recording costs a real run."""

from __future__ import annotations

import pytest

from shardflow.train.profiling import RECORDER_ENV, _AlternatingRecorder, _make_recorder, _NoRecorder


def test_the_setting_picks_the_recorder(monkeypatch):
    monkeypatch.delenv(RECORDER_ENV, raising=False)
    assert type(_make_recorder("worker:0")).__name__ == "SpanRecorder"
    monkeypatch.setenv(RECORDER_ENV, "off")
    assert isinstance(_make_recorder("worker:0"), _NoRecorder)
    monkeypatch.setenv(RECORDER_ENV, "alternate:300")
    recorder = _make_recorder("worker:0")
    assert isinstance(recorder, _AlternatingRecorder) and recorder.block == 300


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(RECORDER_ENV, "sometimes")
    with pytest.raises(ValueError, match="SHARDFLOW_RECORDER='sometimes': use on, off or alternate:N"):
        _make_recorder("worker:0")


def test_alternating_records_only_in_even_blocks():
    recorder = _AlternatingRecorder("worker:0", block=10)
    for step in range(40):
        recorder.at_step(step)
        recorder.end("step", step, 1)
        recorder.flow("push", step, step, True)
    steps = sorted({event["args"]["step"] for event in recorder.events(0, 40)})
    assert steps == [*range(0, 10), *range(20, 30)]
