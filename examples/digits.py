"""Handwritten digits: scikit-learn's bundled 8x8 images (no download), an MLP trained to >= 95% test accuracy.

It evaluates every few global steps, so `shardflow scale` can tell how many steps and seconds each cluster size
needs to reach a target:

    python examples/digits.py                         # a local cluster: chief, 1 PS, 2 workers
    python examples/digits.py --workers 4 --mode sync
    python examples/digits.py --strategy allreduce    # no PS: the workers all-reduce their gradients (gloo)
    shardflow scale examples/digits.py --workers 1,2,4 --target 'accuracy>=0.95'

The script runs in every process of the cluster; the code after train_and_evaluate runs once, in the chief. It needs
scikit-learn, which `make demo` does not install: `.venv/bin/pip install scikit-learn` (`make test` installs it).
"""

# ruff: noqa: E402  (most imports follow parse_args(), so that --help does not wait for torch to load)
from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training images, cluster-wide (20)")
    parser.add_argument("--eval-every", type=int, default=25, help="evaluate every this many global steps (25)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the local cluster (2)")
    parser.add_argument("--ps", type=int, default=1, help="parameter servers of the local cluster (1)")
    parser.add_argument("--mode", choices=["async", "sync", "ssp"], default="async", help="the PS strategy's (async)")
    parser.add_argument(
        "--strategy", choices=["ps", "allreduce"], default="ps", help="parameter servers, or all-reduce (ps)"
    )
    parser.add_argument("--model-dir", default="runs/digits", help="checkpoints, logs, TensorBoard")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()

# torch before shardflow: the local cluster's zygote is then forked from this process with torch imported.
import numpy as np
import torch
from summary import command, print_summary

import shardflow as sf
from shardflow import data

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError:
    raise SystemExit(
        "digits.py reads scikit-learn's bundled digits, and scikit-learn is not installed (`make demo` leaves it "
        f"out): {command('pip')} install scikit-learn"
    ) from None

BATCH_SIZE = 32
TARGET_ACCURACY = 0.95


def digits() -> tuple[np.ndarray, ...]:
    """1,437 training and 360 test images as float32 in [0, 1] with int64 labels (the same split in every role)."""
    images, labels = load_digits(return_X_y=True)
    return train_test_split(
        (images / 16).astype(np.float32), labels.astype(np.int64), test_size=0.2, stratify=labels, random_state=0
    )


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(images), labels)


def accuracy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return (model(images).argmax(dim=1) == labels).float().mean()


def strategy(args: argparse.Namespace) -> sf.ParameterServerStrategy | sf.AllReduceStrategy:
    if args.strategy == "allreduce":
        return sf.AllReduceStrategy(num_workers=args.workers)
    return sf.ParameterServerStrategy(num_ps=args.ps, num_workers=args.workers, mode=args.mode)


def main(args: argparse.Namespace) -> None:
    train_images, test_images, train_labels, test_labels = digits()

    def input_fn(ctx: sf.InputContext) -> data.Dataset:
        # Called once per epoch; each worker takes every num_workers-th image, so an epoch sees each image once.
        images = data.Dataset.from_tensor_slices((train_images, train_labels))
        images = data.auto_shard(images, ctx.num_workers, ctx.worker_index, data.AutoShardPolicy.DATA)
        return images.shuffle(len(train_labels)).batch(BATCH_SIZE).prefetch(data.AUTOTUNE)

    def eval_input_fn(ctx: sf.InputContext) -> data.Dataset:
        return data.Dataset.from_tensors((test_images, test_labels))  # all 360 test images in one batch

    est = sf.Estimator(
        model_fn=model_fn,
        loss_fn=loss_fn,
        optimizer=sf.optim.Adam(lr=2e-3),
        strategy=strategy(args),
        model_dir=args.model_dir,
    )
    result = sf.train_and_evaluate(
        est,
        sf.TrainSpec(input_fn, epochs=args.epochs),
        sf.EvalSpec(eval_input_fn, metrics={"accuracy": accuracy}, every_n_steps=args.eval_every),
    )

    reached = next((e for e in result.eval_history if e["metrics"]["accuracy"] >= TARGET_ACCURACY), None)
    when = (
        f"first reached at global step {reached['global_step']}, {reached['elapsed_s']:.1f} s into training"
        if reached
        else "not reached"
    )
    print_summary(
        f"digits: an MLP on scikit-learn's 8x8 digits ({len(train_labels)} train, {len(test_labels)} test images); "
        + (f"{args.mode} PS training" if args.strategy == "ps" else "all-reduce training"),
        est,
        result,
        [
            f"test accuracy    {result.metrics['accuracy']:.1%}, test loss {result.metrics['loss']:.3f}",
            f"{TARGET_ACCURACY:.0%} accuracy     {when} ({len(result.eval_history)} evaluations)",
        ],
    )


if __name__ == "__main__":
    main(args)
