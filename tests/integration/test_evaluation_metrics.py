"""Evaluation metrics of real local jobs are exact over the whole evaluation set, inline on the chief and on the
side-car evaluator: the AUC is scikit-learn's over every score, a mean is the mean over every example."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from sklearn.metrics import roc_auc_score

HAVE_TORCHMETRICS = importlib.util.find_spec("torchmetrics") is not None
"""The job adds a torchmetrics pair where torchmetrics is installed (the test extra)."""


def _expected(result: dict) -> dict[str, float]:
    """The metrics of the final model, computed in one piece from its score of every evaluation example."""
    scores, labels = torch.tensor(result["scores"]), torch.tensor(result["labels"])
    return {
        "auc": roc_auc_score(labels.numpy(), scores.numpy()),
        # torchmetrics is given the sigmoid of each batch's scores: a vectorized sigmoid can break a tie
        "torchmetrics_auroc": roc_auc_score(labels.numpy(), result["probabilities"]),
        "accuracy": ((scores > 0) == labels.bool()).double().mean().item(),
        "loss": torch.nn.functional.binary_cross_entropy_with_logits(scores.double(), labels.double()).item(),
    }


def _assert_exact(metrics: dict[str, float], expected: dict[str, float]) -> None:
    assert metrics["auc"] == pytest.approx(expected["auc"], abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert ("torchmetrics_auroc" in metrics) == HAVE_TORCHMETRICS
    if HAVE_TORCHMETRICS:
        assert metrics["torchmetrics_auroc"] == pytest.approx(expected["torchmetrics_auroc"], abs=1e-6)


def test_chief_evaluation_of_a_job_is_exact_over_20_batches(run_job):
    proc, result = run_job("evaluated.py", max_steps=20, eval_every_n_steps=10)
    assert proc.returncode == 0, proc.stdout
    assert [entry["global_step"] for entry in result["eval_history"]] == [10, 20]
    assert result["eval_history"][-1]["metrics"] == result["metrics"]
    _assert_exact(result["metrics"], _expected(result))


def test_side_car_evaluator_of_a_job_is_exact_over_20_batches(run_job, tmp_path):
    proc, result = run_job("evaluated.py", max_steps=20, save_checkpoints_steps=10, evaluator=True)
    assert proc.returncode == 0, proc.stdout
    history = [json.loads(line) for line in (tmp_path / "model" / "eval" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["global_step"] == 20
    assert history[-1]["metrics"] == result["metrics"]
    _assert_exact(result["metrics"], _expected(result))
