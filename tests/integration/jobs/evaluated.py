"""A click-through-like job evaluated on 20 uneven batches, configured by the JSON file in argv[1].

Its result holds TrainResult.metrics and eval_history, and the final model's score of every evaluation example,
so that a test can compute the metrics again in one piece (scikit-learn's AUC, the exact mean)."""

import json
import sys
from typing import Any

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
generator = torch.Generator().manual_seed(11)
WEIGHTS = torch.tensor([1.5, -2.0, 0.5, 1.0])
EVAL_BATCH_SIZES = [7, 31, 1, 64, 12, 50, 3, 40, 25, 9, 64, 2, 17, 33, 48, 5, 60, 11, 29, 38]


def examples(num: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(num, 4, generator=generator).round(decimals=1)  # coarse features: scores that tie
    clicked = (x @ WEIGHTS + torch.randn(num, generator=generator) > 0).float()
    return x, clicked


TRAIN_X, TRAIN_Y = examples(16 * 40)
EVAL_X, EVAL_Y = examples(sum(EVAL_BATCH_SIZES))


def input_fn(ctx: sf.InputContext):
    for b in range(ctx.worker_index, 40, ctx.num_workers):
        yield TRAIN_X[b * 16 : (b + 1) * 16], TRAIN_Y[b * 16 : (b + 1) * 16]


def eval_input_fn(ctx: sf.InputContext):
    start = 0
    for size in EVAL_BATCH_SIZES:
        yield EVAL_X[start : start + size], EVAL_Y[start : start + size]
        start += size


def scores(model, batch):
    return model(batch[0]).squeeze(-1)


def loss_fn(model, batch):
    return torch.nn.functional.binary_cross_entropy_with_logits(scores(model, batch), batch[1])


metrics: dict[str, Any] = {
    "auc": (sf.metrics.AUC(), lambda model, batch: (scores(model, batch), batch[1])),
    "accuracy": lambda model, batch: (scores(model, batch) > 0) == batch[1].bool(),
}
try:
    from torchmetrics.classification import BinaryAUROC

    metrics["torchmetrics_auroc"] = (
        BinaryAUROC(),
        lambda model, batch: (scores(model, batch).sigmoid(), batch[1].long()),
    )
except ImportError:
    pass

est = sf.Estimator(
    lambda: torch.nn.Linear(4, 1),
    loss_fn,
    sf.optim.SGD(lr=0.1),
    sf.ParameterServerStrategy(num_ps=1, num_workers=2, mode="sync", evaluator=config.get("evaluator", False)),
    config["model_dir"],
    save_checkpoints_steps=config.get("save_checkpoints_steps"),
)
eval_spec = sf.EvalSpec(eval_input_fn, metrics=metrics, every_n_steps=config.get("eval_every_n_steps"))
result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=config["max_steps"]), eval_spec)

model = est.build_model()
model.load_state_dict(est.state_dict())
with torch.no_grad():  # batch by batch as evaluation scores them, so that ties stay ties to the last bit
    final_scores = [scores(model, batch) for batch in eval_input_fn(sf.InputContext())]
with open(config["result"], "w") as f:
    json.dump(
        {
            "global_step": result.global_step,
            "metrics": result.metrics,
            "eval_history": result.eval_history,
            "scores": torch.cat(final_scores).tolist(),
            "probabilities": torch.cat([batch_scores.sigmoid() for batch_scores in final_scores]).tolist(),
            "labels": EVAL_Y.tolist(),
        },
        f,
    )
