"""SHARDFLOW_RECORDER: on (the default), off, or alternate:N for measuring what recording costs a real run."""

from __future__ import annotations

import pytest

from shardflow import env
from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.recorder_setting import AlternatingRecorder, NoRecorder, make_recorder
from shardflow.profile.spans import PUSH, STEP


def test_the_setting_picks_the_recorder(monkeypatch):
    monkeypatch.delenv(env.RECORDER, raising=False)
    assert type(make_recorder("worker:0")) is SpanRecorder
    monkeypatch.setenv(env.RECORDER, "off")
    assert isinstance(make_recorder("worker:0"), NoRecorder)
    monkeypatch.setenv(env.RECORDER, "alternate:300")
    recorder = make_recorder("worker:0")
    assert isinstance(recorder, AlternatingRecorder) and recorder.block == 300


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(env.RECORDER, "sometimes")
    with pytest.raises(ValueError, match="SHARDFLOW_RECORDER='sometimes': use on, off or alternate:N"):
        make_recorder("worker:0")


def test_the_recorder_that_is_off_records_nothing():
    recorder = NoRecorder("worker:0")
    recorder.end(STEP, 0, 1)
    recorder.flow(PUSH, 0, 0, True)
    assert recorder.events(0, 1) == []


def test_alternating_records_only_in_even_blocks():
    recorder = AlternatingRecorder("worker:0", block=10)
    for step in range(40):
        recorder.at_step(step)
        recorder.end(STEP, step, 1)
        recorder.flow(PUSH, step, step, True)
    steps = sorted({event["args"]["step"] for event in recorder.events(0, 40)})
    assert steps == [*range(0, 10), *range(20, 30)]
