"""Evaluation metrics are exact over the whole evaluation set: AUC from every score, means over every example."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

import shardflow as sf
from shardflow.train.evaluation import evaluate_model

BATCH_SIZES = [7, 31, 1, 64, 12, 50, 3, 40, 25, 9, 64, 2, 17, 33, 48, 5, 60, 11, 29, 38]
"""20 batches of uneven sizes: a mean of batch means is not the mean of the examples."""


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """Features of few distinct values, so that many scores tie; labels that depend on them, with noise."""
    rng = np.random.default_rng(3)
    batches = []
    for size in BATCH_SIZES:
        x = rng.integers(0, 3, (size, 2)).astype(np.float32)
        y = ((x[:, 0] - x[:, 1] + rng.normal(0, 1, size)) > 0).astype(np.float32)
        batches.append((x, y))
    return batches


BATCHES = _batches()
ALL_Y = torch.from_numpy(np.concatenate([y for _, y in BATCHES]))


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def scores(model, batch):
    return model(batch[0]).squeeze(-1)


def loss_fn(model, batch):
    return torch.nn.functional.binary_cross_entropy_with_logits(scores(model, batch), batch[1])


def all_scores(model) -> torch.Tensor:
    """The score of every example, batch by batch as evaluation computes them, so ties stay ties to the last bit."""
    with torch.no_grad():
        return torch.cat([scores(model, (torch.from_numpy(x),)) for x, _ in BATCHES])


def evaluate(model, **spec):
    return evaluate_model(model, loss_fn, sf.EvalSpec(lambda ctx: iter(BATCHES), **spec))


def test_evaluation_auc_over_20_batches_equals_scikit_learn():
    model = _model()
    result = evaluate(model, metrics={"auc": (sf.metrics.AUC(), lambda m, b: (scores(m, b), b[1]))})
    expected = roc_auc_score(ALL_Y.numpy(), all_scores(model).numpy())
    assert len(torch.unique(all_scores(model))) < len(ALL_Y) / 10  # most scores tie
    assert result["auc"] == pytest.approx(expected, abs=1e-6)


def test_per_example_metric_over_uneven_batches_is_the_exact_mean():
    model = _model()
    result = evaluate(model, metrics={"accuracy": lambda m, b: (scores(m, b) > 0) == b[1].bool()})
    expected = ((all_scores(model) > 0) == ALL_Y.bool()).double().mean().item()
    assert result["accuracy"] == pytest.approx(expected, abs=1e-12)


def test_scalar_metric_is_weighted_by_the_batch_size():
    model = _model()
    result = evaluate(model, metrics={"mean_score": lambda m, b: scores(m, b).mean().item()})
    expected = all_scores(model).double().mean().item()
    assert result["mean_score"] == pytest.approx(expected, abs=1e-6)


def test_loss_is_the_mean_over_every_example_not_over_batches():
    model = _model()
    with torch.no_grad():
        expected = torch.nn.functional.binary_cross_entropy_with_logits(all_scores(model), ALL_Y).item()
        mean_of_batch_means = np.mean([loss_fn(model, (torch.from_numpy(x), torch.from_numpy(y))) for x, y in BATCHES])
    assert abs(mean_of_batch_means - expected) > 1e-3  # the old rule would fail this test
    assert evaluate(model)["loss"] == pytest.approx(expected, abs=1e-6)


def test_steps_evaluates_only_the_first_batches():
    model = _model()
    x, y = (torch.from_numpy(np.concatenate(parts[:2])) for parts in zip(*BATCHES, strict=True))
    with torch.no_grad():
        expected = loss_fn(model, (x, y)).item()
    assert evaluate(model, steps=2)["loss"] == pytest.approx(expected, abs=1e-6)


def test_torchmetrics_pair_is_computed_over_the_whole_set():
    torchmetrics = pytest.importorskip("torchmetrics")
    model = _model()
    metrics = {
        "auroc": (torchmetrics.classification.BinaryAUROC(), lambda m, b: (scores(m, b).sigmoid(), b[1].long())),
        "mse": (torchmetrics.MeanSquaredError(), lambda m, b: (scores(m, b), b[1])),
    }
    result = evaluate(model, metrics=metrics)
    every_score = all_scores(model)
    with torch.no_grad():  # sigmoid batch by batch, as the pair computed it: a vectorized sigmoid can break ties
        probabilities = torch.cat([scores(model, (torch.from_numpy(x),)).sigmoid() for x, _ in BATCHES])
    assert result["auroc"] == pytest.approx(roc_auc_score(ALL_Y.numpy(), probabilities.numpy()), abs=1e-6)
    assert result["mse"] == pytest.approx(((every_score - ALL_Y) ** 2).mean().item(), abs=1e-6)


def test_a_metric_object_starts_afresh_at_each_evaluation():
    model = _model()
    spec = sf.EvalSpec(lambda ctx: iter(BATCHES), metrics={"auc": (sf.metrics.AUC(), lambda m, b: (m(b[0]), b[1]))})
    first = evaluate_model(model, loss_fn, spec)
    with torch.no_grad():
        model.weight.neg_()  # reverses the order of the scores
    second = evaluate_model(model, loss_fn, spec)
    assert second["auc"] == pytest.approx(1 - first["auc"], abs=1e-9)


def test_evaluation_input_with_no_batch_is_refused():
    with pytest.raises(ValueError, match=r"EvalSpec.input_fn yielded no batch"):
        evaluate_model(_model(), loss_fn, sf.EvalSpec(lambda ctx: iter([])))


def test_scalar_metric_of_a_batch_without_a_tensor_is_refused_naming_the_metric():
    spec = sf.EvalSpec(lambda ctx: iter([{"text": ["a", "b"]}]), metrics={"one": lambda m, b: 1.0})
    with pytest.raises(ValueError, match=r"EvalSpec.metrics\['one'\] returned one number for a batch that holds no"):
        evaluate_model(_model(), lambda m, b: torch.zeros(2), spec)


def test_metric_computing_several_values_is_refused_naming_the_metric():
    class PerClass(sf.metrics.Mean):
        def compute(self):
            return torch.tensor([0.5, 0.7])

    metrics = {"per_class": (PerClass(), lambda m, b: scores(m, b))}
    with pytest.raises(ValueError, match=r"metrics\['per_class'\]: compute\(\) returned a tensor of shape \[2\]"):
        evaluate(_model(), metrics=metrics)


def test_metric_without_its_function_is_refused_naming_the_metric():
    with pytest.raises(ValueError, match=r"EvalSpec.metrics\['auc'\] is a metric with no function to feed it"):
        sf.EvalSpec(lambda ctx: iter(BATCHES), metrics={"auc": sf.metrics.AUC()})  # type: ignore[dict-item]


def test_a_metric_named_loss_is_refused():
    with pytest.raises(ValueError, match=r"cannot name a metric 'loss'"):
        sf.EvalSpec(lambda ctx: iter(BATCHES), metrics={"loss": lambda m, b: 0.0})


def test_auc_of_parts_merged_equals_the_auc_of_all():
    all_scores = torch.from_numpy(np.random.default_rng(5).normal(size=300)).round(decimals=1)
    labels = (all_scores + torch.from_numpy(np.random.default_rng(6).normal(size=300)) > 0).long()
    first, second = sf.metrics.AUC(), sf.metrics.AUC()
    first.update(all_scores[:120], labels[:120])
    second.update(all_scores[120:], labels[120:])
    first.merge(second)
    assert first.compute() == pytest.approx(roc_auc_score(labels.numpy(), all_scores.numpy()), abs=1e-12)


def test_mean_of_parts_merged_equals_the_mean_of_all():
    first, second = sf.metrics.Mean(), sf.metrics.Mean()
    first.update(torch.tensor([1.0, 2.0, 3.0]))
    second.update(10.0, weight=2)
    first.merge(second)
    assert first.compute() == pytest.approx(26 / 5)


def test_auc_of_labels_of_one_class_is_nan():
    auc = sf.metrics.AUC()
    auc.update(torch.tensor([0.1, 0.9]), torch.tensor([1, 1]))
    assert math.isnan(auc.compute())


def test_auc_refuses_labels_other_than_zero_and_one():
    with pytest.raises(ValueError, match=r"AUC labels must be 0 or 1, got 2"):
        sf.metrics.AUC().update(torch.tensor([0.1, 0.9]), torch.tensor([1, 2]))
