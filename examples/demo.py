"""The demo: a local cluster (chief, 2 parameter servers, 2 workers) trains a classifier, then reports.

Run it with `make demo`, or `python examples/demo.py`. Each role is its own process on 127.0.0.1;
this script is re-run in every one of them, and the code after train_and_evaluate runs once, in the chief.
"""

from __future__ import annotations

import math

import torch

import shardflow as sf

NUM_CLASSES, FEATURES, RECORDS, BATCH = 4, 16, 32_768, 64


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four interleaved spirals in 2-D, lifted to 16 features by a fixed random projection plus noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (RECORDS,), generator=g)
    radius = torch.rand(RECORDS, generator=g) * 3 + 0.2
    angle = radius * 1.6 + labels * (2 * math.pi / NUM_CLASSES) + 0.15 * torch.randn(RECORDS, generator=g)
    plane = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    projection = torch.randn(2, FEATURES, generator=torch.Generator().manual_seed(0))
    return plane @ projection + 0.05 * torch.randn(RECORDS, FEATURES, generator=g), labels


def input_fn(ctx: sf.InputContext):
    x, y = make_data(seed=1)
    # Each worker reads its own shard of the batches, so one epoch sees every record once cluster-wide.
    for start in range(ctx.worker_index * BATCH, RECORDS, ctx.num_workers * BATCH):
        yield x[start : start + BATCH], y[start : start + BATCH]


def eval_input_fn(ctx: sf.InputContext):
    x, y = make_data(seed=2)
    for start in range(0, 8192, 512):
        yield x[start : start + 512], y[start : start + 512]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, NUM_CLASSES),
    )


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def accuracy(model: torch.nn.Module, batch) -> float:
    x, y = batch
    return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    est = sf.Estimator(
        model_fn=model_fn,
        loss_fn=loss_fn,
        optimizer=sf.optim.Adam(lr=3e-3),
        strategy=sf.ParameterServerStrategy(num_ps=2, num_workers=2, mode="async"),
        model_dir="runs/demo",
    )
    result = sf.train_and_evaluate(
        est,
        sf.TrainSpec(input_fn, epochs=4),
        sf.EvalSpec(eval_input_fn, metrics={"accuracy": accuracy}),
    )
    print()
    print("shardflow demo: async parameter-server training on a local cluster (chief, 2 PS, 2 workers)")
    resumed = f", resumed from step {result.start_step} in {est.model_dir}" if result.start_step else ""
    print(f"  global step      {result.global_step}  (one per applied worker update; {result.worker_steps}{resumed})")
    print(f"  loss             {result.first_loss:.3f} at the start -> {result.final_loss:.3f} at the end")
    print(f"  throughput       {result.global_steps_per_s:.0f} global steps/s over {result.training_s:.1f}s")
    print(f"  eval             loss {result.metrics['loss']:.3f}, accuracy {result.metrics['accuracy']:.3f}")
    print(f"  checkpoint       {result.checkpoint}")
    print("  (TensorBoard logs, the merged trace and the HTML report arrive with the profiler and summaries.)")


if __name__ == "__main__":
    main()
