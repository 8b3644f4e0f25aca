"""A character-level language model over the Python standard library's own source files.

Real text on every machine, nothing to download: the standard library's *.py files are FILE-sharded across the
workers, interleaved, cut into fixed-length byte windows, shuffled and batched by shardflow.data, and a small LSTM
learns to predict each next byte. Every 20th file is held out for evaluation.

    python examples/char_lm.py                        # a local cluster: chief, 2 PS, 2 workers
    python examples/char_lm.py --max-steps 100        # a quick look
    shardflow launch --workers 4 --ps 2 examples/char_lm.py

The script runs in every process of the cluster; the code after train_and_evaluate runs once, in the chief.
"""

# ruff: noqa: E402  (most imports follow parse_args(), so that --help does not wait for torch to load)
from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=1200, help="global steps to train to (1200)")
    parser.add_argument("--model-dir", default="runs/char_lm", help="checkpoints, logs, TensorBoard, profile")
    parser.add_argument("--profile-steps", default="100:103", help="profile global steps [A, B) (100:103; '' for none)")
    parser.add_argument("--max-files", type=int, help="read only this many source files (for a quick test)")
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches of 64 windows (20)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()

import glob
import math
import os
import sys
import sysconfig

import numpy as np
import torch
from summary import command, print_summary, shell_path

import shardflow as sf
from shardflow import data

VOCAB_SIZE = 256  # bytes, so any file decodes
WINDOW = 64  # bytes of context per training sequence
BATCH_SIZE = 32
HELD_OUT_EVERY = 20


def stdlib_sources(max_files: int | None) -> tuple[list[str], list[str]]:
    """The standard library's .py files (not installed packages), split into training and held-out files."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(
        path
        for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        if "site-packages" not in path and "dist-packages" not in path
    )[:max_files]
    if len(files) < HELD_OUT_EVERY:
        raise ValueError(
            f"found {len(files)} .py files under {root}; this example needs at least {HELD_OUT_EVERY} of the "
            "standard library's sources (check --max-files)"
        )
    held_out = files[::HELD_OUT_EVERY]
    return sorted(set(files) - set(held_out)), held_out


def to_windows(lines: np.ndarray) -> np.ndarray:
    """A block of consecutive lines of one file -> as many (WINDOW + 1)-byte windows as it fills."""
    text = np.frombuffer(b"\n".join(lines.tolist()) + b"\n", dtype=np.uint8)
    count = len(text) // (WINDOW + 1)
    return text[: count * (WINDOW + 1)].reshape(count, WINDOW + 1)


def windows(files: list[str], ctx: sf.InputContext, shuffle: bool) -> data.Dataset:
    names = data.Dataset.list_files(files, shuffle=shuffle, seed=0)
    names = data.auto_shard(names, ctx.num_workers, ctx.worker_index, data.AutoShardPolicy.FILE)
    # Lines are batched inside each file before the interleave, so a window never spans two files.
    return (
        names.interleave(
            lambda name: data.TextLineDataset(name).batch(32),
            cycle_length=4,
            num_parallel_calls=data.AUTOTUNE,
        )
        .map(to_windows, num_parallel_calls=data.AUTOTUNE)
        .unbatch()
    )


class CharLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB_SIZE, 32)
        self.lstm = torch.nn.LSTM(32, 128, batch_first=True)
        self.head = torch.nn.Linear(128, VOCAB_SIZE)

    def forward(self, ids: torch.Tensor, state=None):
        hidden, state = self.lstm(self.embedding(ids), state)
        return self.head(hidden), state


def loss_fn(model: CharLM, batch: torch.Tensor) -> torch.Tensor:
    ids = batch.long()
    logits, _ = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def next_byte_accuracy(model: CharLM, batch: torch.Tensor) -> torch.Tensor:
    ids = batch.long()
    logits, _ = model(ids[:, :-1])
    return (logits.argmax(dim=-1) == ids[:, 1:]).float().mean()


def sample(model: CharLM, prompt: bytes, length: int, temperature: float = 0.7) -> str:
    generator = torch.Generator().manual_seed(0)
    ids, state, out = torch.tensor([list(prompt)]), None, list(prompt)
    with torch.no_grad():
        for _ in range(length):
            logits, state = model(ids, state)
            next_id = torch.multinomial(torch.softmax(logits[0, -1] / temperature, dim=-1), 1, generator=generator)
            out.append(int(next_id))
            ids = next_id.view(1, 1)
    return bytes(out).decode("utf-8", errors="replace")


def main(args: argparse.Namespace) -> None:
    train_files, held_out_files = stdlib_sources(args.max_files)

    def input_fn(ctx: sf.InputContext) -> data.Dataset:
        return (
            windows(train_files, ctx, shuffle=True)
            .shuffle(2048, seed=ctx.worker_index)
            .batch(BATCH_SIZE, drop_remainder=True)
            .prefetch(data.AUTOTUNE)
        )

    def eval_input_fn(ctx: sf.InputContext) -> data.Dataset:
        return windows(held_out_files, ctx, shuffle=False).batch(64).take(args.eval_batches)

    profile_steps = tuple(int(step) for step in args.profile_steps.split(":")) if args.profile_steps else None
    est = sf.Estimator(
        model_fn=CharLM,
        loss_fn=loss_fn,
        optimizer=sf.optim.Adam(lr=1e-2),
        strategy=sf.ParameterServerStrategy(num_ps=2, num_workers=2, mode="async"),
        model_dir=args.model_dir,
        profile_steps=profile_steps,
        save_summary_steps=10,  # a TensorBoard loss curve of 20 points for the demo's 200 steps
    )
    result = sf.train_and_evaluate(
        est,
        sf.TrainSpec(input_fn, max_steps=args.max_steps),
        sf.EvalSpec(eval_input_fn, metrics={"next_byte_accuracy": next_byte_accuracy}),
    )

    model = CharLM()
    model.load_state_dict(est.state_dict())
    eval_loss = result.metrics["loss"]
    generated = sample(model, b"def ", 240).splitlines()[:6]
    print_summary(
        f"char_lm: an LSTM over {len(train_files)} standard-library files, "
        f"{len(held_out_files)} held out; async PS training",
        est,
        result,
        [
            f"held-out loss    {eval_loss:.3f} nats/byte = {eval_loss / math.log(2):.2f} bits/byte, "
            f"perplexity {math.exp(eval_loss):.2f} (uniform over bytes: {VOCAB_SIZE})",
            f"held-out acc.    {result.metrics['next_byte_accuracy']:.1%} of next bytes predicted",
            *(f"{'sample' if i == 0 else '':17}| {line}".rstrip() for i, line in enumerate(generated)),
            f"train further    {command('python')} {shell_path(sys.argv[0])} --model-dir {shell_path(est.model_dir)} "
            f"--max-steps {result.global_step + args.max_steps}  (continues from the last checkpoint)",
        ],
    )


if __name__ == "__main__":
    main(args)
