"""`shardflow profile ...` on the hand-built fixture capture: parse, run, check what is printed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardflow.cli.main import main
from shardflow.profile.capture import write_capture
from shardflow.profile.trace import read_trace

FIXTURE = Path(__file__).parents[1] / "profile" / "fixtures" / "three_roles"


@pytest.fixture
def fixture_model_dir(tmp_path):
    """MODEL_DIR with the hand-built 3-role capture of tests/profile/fixtures, merged as the chief leaves it."""
    write_capture(
        [read_trace(path) for path in sorted(FIXTURE.glob("*.trace.json"))], tmp_path / "model" / "profile" / "fixture"
    )
    return tmp_path / "model"


def profile(capsys, *args):
    code = main(["profile", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_steps_prints_the_breakdown_and_the_diagnosis(capsys, fixture_model_dir):
    code, out, _ = profile(capsys, "steps", fixture_model_dir)
    assert code == 0
    worker = next(line for line in out.splitlines() if line.startswith("worker:0"))
    assert worker.split()[:5] == ["worker:0", "3", "1.000", "0.200", "(20%)"]
    assert "diagnosis: compute-bound: forward and backward take 60% of each step" in out


def test_steps_per_step_prints_one_line_per_role_and_step(capsys, fixture_model_dir):
    _, out, _ = profile(capsys, "steps", fixture_model_dir, "--per-step", "--steps", "1:3")
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("worker:0")] == [
        ["worker:0", "1"],
        ["worker:0", "2"],
    ]


def test_top_with_a_filter_rolls_hidden_ops_into_shown_ones(capsys, fixture_model_dir):
    code, out, _ = profile(capsys, "top", fixture_model_dir, "--filter", "^aten::linear$|Backward")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows == [
        ["aten::linear", "3", "0.600", "0.600", "51.3%"],
        ["AddmmBackward0", "3", "0.570", "0.570", "48.7%"],
    ]


def test_top_by_memory_grouped_by_shape(capsys, fixture_model_dir):
    _, out, _ = profile(capsys, "top", fixture_model_dir, "--by", "memory", "--group-by", "shape", "--steps", "0:1")
    assert out.splitlines()[2].split() == ["[[32,64],[64,64]]", "1", "0.016", "0.016", "66.7%"]


def test_memory_names_the_peak_and_what_was_live(capsys, fixture_model_dir):
    _, out, _ = profile(capsys, "memory", fixture_model_dir)
    lines = [line.split() for line in out.splitlines()]
    assert ["worker:0", "memory.rss", "152.000", "13.000", "2", "step", ">", "backward"] in lines
    assert ["worker:0", "memory.torch_cpu_allocated", "0.016", "1", "aten::mm", "[[32,64],[64,64]]", "cpu"] in lines


def test_diff_of_two_model_dirs(capsys, fixture_model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(fixture_model_dir, other)
    code, out, _ = profile(capsys, "diff", fixture_model_dir, other, "--limit", "2")
    assert code == 0
    assert len(out.splitlines()) == 4 and out.splitlines()[2].endswith("+0.000")


def test_sql_queries_the_events_view(capsys, fixture_model_dir):
    query = "SELECT role, count(*) AS applies, sum(bytes) AS total FROM events WHERE name = 'apply' GROUP BY role"
    code, out, _ = profile(capsys, "sql", fixture_model_dir, query)
    assert code == 0
    assert out.splitlines()[2].split() == ["ps:0", "3", "12000"]


def test_a_bad_query_is_an_error_naming_the_problem(capsys, fixture_model_dir):
    code, _, err = profile(capsys, "sql", fixture_model_dir, "SELECT nope FROM events")
    assert code == 2 and "the query failed" in err


def test_report_writes_html_where_asked(capsys, fixture_model_dir, tmp_path):
    code, out, _ = profile(capsys, "report", fixture_model_dir, "-o", tmp_path / "out.html")
    assert code == 0 and out.strip() == str(tmp_path / "out.html")
    assert (tmp_path / "out.html").read_text().startswith("<!DOCTYPE html>")


def test_capture_without_a_running_job_says_so(capsys, tmp_path):
    code, _, err = profile(capsys, "capture", tmp_path, "--steps", "3")
    assert code == 1 and "no running job" in err and "job.json" in err


def test_a_model_dir_without_captures_says_how_to_make_one(capsys, tmp_path):
    code, _, err = profile(capsys, "steps", tmp_path)
    assert code == 2 and "profile_steps" in err


def test_a_named_capture_that_does_not_exist_is_an_error(capsys, fixture_model_dir):
    code, _, err = profile(capsys, "top", fixture_model_dir, "--capture", "nope")
    assert code == 2 and "no capture 'nope'" in err


def test_malformed_step_range_is_rejected_by_the_parser(capsys, fixture_model_dir):
    with pytest.raises(SystemExit):
        main(["profile", "top", str(fixture_model_dir), "--steps", "a:b"])
    assert "expected A:B" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly(fixture_model_dir):
    """`shardflow profile top DIR | head -1`: the reader closes the pipe before the table is written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "shardflow", "profile", "top", str(fixture_model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    error = process.stderr.read().decode()
    assert process.wait(timeout=60) in (0, 141)
    assert "Traceback" not in error and "BrokenPipeError" not in error, error
