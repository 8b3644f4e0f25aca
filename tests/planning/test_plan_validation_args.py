"""benchmarks/plan_validation.py's command line: the models and strategies it sweeps, and what it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plan_validation import parse_args


def test_both_models_sweep_the_mlp_then_the_click_model():
    args = parse_args(["--model", "both", "--strategies", "ps,allreduce,hybrid", "--workers", "2,1,4"])
    assert [model.name for model in args.models] == ["mlp", "click"]
    assert (args.sizes, args.strategy_names) == ([2, 1, 4], ["ps", "allreduce", "hybrid"])


def test_the_click_model_skips_allreduce_and_the_mlp_hybrid_saying_why():
    mlp, click = parse_args(["--model", "both"]).models
    assert mlp.skipped == {"hybrid": "= all-reduce (no sf.nn tables)"}
    assert click.skipped["allreduce"].startswith("not run: all-reduce cannot hold the table")


def test_the_strategies_must_include_the_ps(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--strategies", "allreduce,hybrid"])
    assert "--strategies: ps is missing" in capsys.readouterr().err


def test_a_size_below_one_worker_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--workers", "2,0"])
    assert "every size must be at least 1" in capsys.readouterr().err


def test_replay_needs_the_directory_an_earlier_run_kept(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--replay"])
    assert "--replay needs --out DIR" in capsys.readouterr().err
    assert parse_args(["--replay", "--out", str(tmp_path)]).replay


def test_replay_names_the_run_it_cannot_find(tmp_path):
    from plan_validation import replayed

    with pytest.raises(SystemExit, match="no run of 4 workers kept in"):
        replayed(tmp_path / "ps", 4)
