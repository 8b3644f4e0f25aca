"""The HTML report of a real 3-step capture (async, a chief, a PS and two workers): its header counts the steps the
capture asked for, its timeline draws every role, and its plots keep their labels clear and span the whole capture."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shardflow.profile import report
from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.diagnose import steps, summarize
from shardflow.profile.events import load
from shardflow.profile.timeline import capture_span_us

JOB = Path(__file__).parents[1] / "integration" / "jobs" / "regression.py"
FIRST, LAST = 5, 8
ROLES = ("chief", "worker:0", "worker:1", "ps:0")


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """The events of global steps [5, 8) of a short async job."""
    tmp = tmp_path_factory.mktemp("report")
    config = {
        "mode": "async",
        "num_ps": 1,
        "num_workers": 2,
        "epochs": 1,
        "num_batches": 40,
        "profile_steps": [FIRST, LAST],
        "model_dir": str(tmp / "model"),
        "result": str(tmp / "result.json"),
    }
    (tmp / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(JOB), str(tmp / "config.json")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return load(finalize(capture_dir(tmp / "model")))


@pytest.fixture(scope="module")
def html(table: pa.Table, tmp_path_factory: pytest.TempPathFactory) -> str:
    return report.write_report(table, tmp_path_factory.mktemp("html") / "report.html").read_text()


def test_the_header_counts_the_global_steps_the_capture_asked_for(html):
    assert f"3 global steps ({FIRST} to {LAST - 1})" in html


def test_the_header_names_every_role_of_the_job(html):
    header = re.search(r'<p class="meta">(.*?)</p>', html)
    assert header is not None
    assert all(role in header[1] for role in ROLES), header[1]


def test_the_timeline_is_an_inline_svg_with_a_lane_for_every_role(html):
    (svg,) = re.findall(r"<svg .*?</svg>", html, flags=re.DOTALL)
    labels = re.findall(r'<text x="[\d.]+" y="[\d.]+" text-anchor="end">([^<]+)</text>', svg)
    assert all(any(label.startswith(role) for label in labels) for role in ROLES), labels
    assert not re.search(r"https?://", html)


def test_the_timeline_draws_every_span_but_torch_ops(table, html):
    not_ops = pc.invert(pc.fill_null(pc.equal(table["cat"], "op"), False))
    spans = table.filter(pc.and_(pc.equal(table["ph"], "X"), not_ops))
    assert html.count("<rect ") == spans.num_rows


@pytest.mark.parametrize("copies", [1, 2], ids=["3 roles", "6 roles"])
def test_the_step_legend_covers_neither_the_axis_label_nor_the_bars(table, copies):
    summaries = summarize(steps(table))
    figure = report._step_bars([replace(s, role=s.role + "'" * i) for i in range(copies) for s in summaries])
    figure.canvas.draw()
    (axes,) = figure.axes
    box = (axes.get_legend() or figure.legends[0]).get_window_extent()
    assert not box.overlaps(axes.xaxis.label.get_window_extent())
    assert not box.overlaps(axes.get_window_extent())


def test_memory_is_drawn_over_the_whole_capture(table):
    start_us, end_us = capture_span_us(table)
    figure = report._memory_lines(table)
    assert [axes.get_xlim() for axes in figure.axes] == [(0.0, (end_us - start_us) / 1000)] * len(figure.axes)


def test_a_ps_step_is_its_time_over_the_global_steps_it_applied(table):
    rows: list[Any] = steps(table)
    (ps,) = [summary for summary in summarize(rows) if summary.role == "ps:0"]
    assert ps.num_steps == LAST - FIRST
    recorded = [r for r in table.filter(pc.equal(table["ph"], "X")).to_pylist() if r["step"] is not None]
    window_us = max(r["ts"] + r["dur"] for r in recorded) - min(r["ts"] for r in recorded)
    assert ps.step_us == pytest.approx(window_us / (LAST - FIRST))
