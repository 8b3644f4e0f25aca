"""The chief's evaluations kept in MODEL_DIR/eval/history.jsonl (train/eval_history.py): read back by a later chief
up to the step it starts from, replaced after a go-back, and a torn line skipped and said."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from shardflow.train.eval_history import EvalHistory, history_path


def _steps(history: EvalHistory) -> list[int]:
    return [e["global_step"] for e in history.entries]


def _file_steps(model_dir: Path) -> list[int]:
    return [json.loads(line)["global_step"] for line in history_path(model_dir).read_text().splitlines()]


def test_a_later_chief_goes_on_from_the_evaluations_up_to_its_step(tmp_path):
    first = EvalHistory(tmp_path, start_step=0)
    for step in (5, 10, 15):
        first.add(step, step / 10, {"loss": 1.0 / step})
    # Restarted at step 12 (the checkpoint before the evaluation at 15): that evaluation is of a training undone.
    second = EvalHistory(tmp_path, start_step=12)
    assert _steps(second) == [5, 10] and _file_steps(tmp_path) == [5, 10]
    assert second.elapsed_before_s == 1.0
    entry = second.add(15, 0.25, {"loss": 0.5})
    assert entry == {"global_step": 15, "elapsed_s": 1.25, "metrics": {"loss": 0.5}}
    assert _file_steps(tmp_path) == [5, 10, 15] and second.values("loss") == [0.2, 0.1, 0.5]


def test_an_evaluation_at_or_before_the_last_replaces_what_came_after(tmp_path):
    # Every PS went back to an earlier checkpoint (a PS was lost) after the evaluations at 10 and 20.
    history = EvalHistory(tmp_path, start_step=0)
    for step in (10, 20, 10):
        history.add(step, 1.0, {"loss": float(step)})
    assert _steps(history) == [10] and _file_steps(tmp_path) == [10]
    assert history.entries[0]["metrics"] == {"loss": 10.0}


def test_a_torn_line_is_skipped_and_said(tmp_path, caplog):
    EvalHistory(tmp_path, start_step=0).add(5, 1.0, {"loss": 1.0})
    with open(history_path(tmp_path), "a") as f:
        f.write('{"global_step": 10, "metr')  # a crash in the middle of a write
    with caplog.at_level(logging.WARNING):
        history = EvalHistory(tmp_path, start_step=100)
    assert _steps(history) == [5]
    assert f"{history_path(tmp_path)}:2: not an evaluation, skipped" in caplog.text


def test_metrics_of_an_earlier_run_that_it_lacks_are_left_out_of_its_values(tmp_path):
    history = EvalHistory(tmp_path, start_step=0)
    history.add(5, 1.0, {"loss": 1.0})
    history.add(10, 2.0, {"loss": 0.5, "auc": 0.7})
    assert history.values("auc") == [0.7] and history.values("loss") == [1.0, 0.5]


def test_nothing_recorded_is_an_empty_history(tmp_path):
    history = EvalHistory(tmp_path, start_step=30)
    assert history.entries == [] and history.elapsed_before_s == 0.0
    assert not history_path(tmp_path).exists()
