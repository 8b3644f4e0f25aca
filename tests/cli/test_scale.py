"""`shardflow scale` on a tiny real job at 1 and 2 workers: the table agrees with the runs' result files."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from shardflow.cli.main import main

JOB = Path(__file__).parent / "jobs" / "tiny_classifier.py"
COLUMNS = ["workers", "sec/step per worker", "global_step/s", "steps to target", "time to target", "final accuracy"]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """Runs the tiny job with 1 and 2 workers (300 global steps, evaluated every 50) once for this module."""
    out = tmp_path_factory.mktemp("scale")
    args = ["--workers", "1,2", "--target", "accuracy>=0.9", "--batch-size", "16", "--profile-steps", "50,150"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["scale", str(JOB), *args, "--out", str(out), "--", "300", "50"])
    print(printed.getvalue())  # shown by pytest when a test fails
    return code, out, printed.getvalue()


def test_scale_exits_zero_and_writes_plot_report_and_summary(scaled):
    code, out, _ = scaled
    assert code == 0
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (out / "scale.html").read_text()
    assert [row["num_workers"] for row in json.loads((out / "scale.json").read_text())["rows"]] == [1, 2]


def test_scale_table_values_follow_from_each_runs_result_file(scaled):
    _, out, _ = scaled
    rows = json.loads((out / "scale.json").read_text())["rows"]
    for row in rows:
        result = json.loads((out / f"workers-{row['num_workers']}" / "result.json").read_text())
        steps = list(result["worker_steps"].values())
        assert row["global_steps_per_s"] == pytest.approx(result["global_step"] / result["training_s"])
        assert row["sec_per_step"] == pytest.approx(sum(result["training_s"] / n for n in steps) / len(steps))
        met = [e for e in result["eval_history"] if e["metrics"]["accuracy"] >= 0.9]
        assert row["target_step"] == (met[0]["global_step"] if met else None)
        assert row["target_s"] == (met[0]["elapsed_s"] if met else None)
        assert row["final_metric"] == pytest.approx(result["metrics"]["accuracy"])
        assert result["num_workers"] == row["num_workers"] and result["mode"] == "async"


def test_scale_prints_the_table_with_the_talks_columns(scaled):
    _, out, printed = scaled
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("workers"))
    assert [c.strip() for c in lines[header].split("  ") if c.strip()] == COLUMNS
    for row, line in zip(json.loads((out / "scale.json").read_text())["rows"], lines[header + 2 :], strict=False):
        cells = line.split()
        assert cells[:3] == [str(row["num_workers"]), f"{row['sec_per_step']:.4f}", f"{row['global_steps_per_s']:.1f}"]
        if row["target_step"] is None:
            assert cells[3:7] == ["not", "reached", "not", "reached"]
        else:
            assert cells[3:5] == [str(row["target_step"]), f"{row['target_s']:.2f}"]


def test_scale_explains_batch_staleness_and_where_the_time_went(scaled):
    _, out, printed = scaled
    assert "plot: " in printed
    text = " ".join(json.loads((out / "scale.json").read_text())["explanation"])
    assert "16 examples per step" in text and "effective batch per global step stays 16" in text
    assert "Staleness" in text and "0 with 1 worker, 1 with 2 workers" in text
    assert "With 2 workers each worker step spends" in text and "Diagnosis:" in text


def test_scale_rejects_an_unreadable_target_before_running_anything(tmp_path, capsys):
    assert main(["scale", str(JOB), "--target", "accuracy=0.9", "--out", str(tmp_path)]) == 2
    assert "e.g. --target 'accuracy>=0.95'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_scale_says_that_the_scripts_own_arguments_go_after_a_double_dash(tmp_path, capsys):
    assert main(["scale", str(JOB), "--workers", "1", "--epochs", "3", "--out", str(tmp_path)]) == 2
    assert "the script's own arguments go after --" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
