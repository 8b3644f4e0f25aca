"""Test job for `shardflow scale` and `shardflow plan --calibrate`: a small MLP on four separable Gaussian blobs.

Usage: shardflow launch --workers N --ps 1 tiny_classifier.py [MAX_STEPS] [EVAL_EVERY]; the model dir, the result
file and the profiled steps come from SHARDFLOW_MODEL_DIR, SHARDFLOW_RESULT_JSON and SHARDFLOW_PROFILE_STEPS.
"""

import sys

import torch

import shardflow as sf

MAX_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
EVAL_EVERY = int(sys.argv[2]) if len(sys.argv) > 2 else 50
BATCH_SIZE = 16
torch.set_num_threads(1)  # every role shares the machine's cores


def blobs(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (count,), generator=generator)
    centers = torch.eye(4, 16) * 3
    return centers[labels] + torch.randn(count, 16, generator=generator), labels


def input_fn(ctx: sf.InputContext):
    features, labels = blobs(1 + ctx.worker_index, 1024)
    while True:
        for i in range(0, 1024, BATCH_SIZE):
            yield features[i : i + BATCH_SIZE], labels[i : i + BATCH_SIZE]


def eval_input_fn(ctx: sf.InputContext):
    features, labels = blobs(0, 256)
    yield features, labels


def loss_fn(model, batch):
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels)


def accuracy(model, batch):
    features, labels = batch
    return (model(features).argmax(dim=1) == labels).float().mean()


est = sf.Estimator(
    model_fn=lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
    loss_fn=loss_fn,
    optimizer=sf.optim.SGD(lr=0.02),
    strategy=sf.ParameterServerStrategy(num_ps=1, mode="async"),
    model_dir="runs/tiny_classifier",
)
sf.train_and_evaluate(
    est,
    sf.TrainSpec(input_fn, max_steps=MAX_STEPS),
    sf.EvalSpec(eval_input_fn, every_n_steps=EVAL_EVERY, metrics={"accuracy": accuracy}),
)
