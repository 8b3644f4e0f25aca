"""Click-through prediction on generated click logs, with embedding tables that live only on the parameter servers.

On first run it writes click logs as TFRecord files of tf.train.Example: user and item ids drawn from Zipf
distributions (a few are very frequent, most are rare, as in real logs), with clicks drawn from a hidden model:
user, item and category effects, each user's taste for categories, the ad's position, the hour and the device.
Training reads them back with TFRecordDataset and parse_example, and hashes a cross feature, user x category, into
an int64 id there. The user and item tables are sf.nn.Embedding: their rows live only on the 2 PS (ids modulo 2),
no worker and not the chief ever allocates them, and a step looks up and pushes only the rows of its batch's ids.
The cross feature has an sf.nn.DynamicEmbedding: any int64 id, a row made on a PS once its id was seen twice.
Adagrad, the classic optimizer for sparse embeddings, applies every table's row gradients on the PS.

    python examples/click_through.py                  # a local cluster: chief, 2 PS, 2 workers
    python examples/click_through.py --strategy hybrid  # the tables on the PS, the MLP all-reduced (gloo)
    shardflow launch --workers 4 --ps 2 examples/click_through.py

The script runs in every process of the cluster; the code after train_and_evaluate runs once, in the chief.
"""

# ruff: noqa: E402  (most imports follow parse_args(), so that --help does not wait for torch to load)
from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000, help="training click records to generate (100000)")
    # More passes overfit the rare ids' rows (the "one-epoch phenomenon" of click models).
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training logs, cluster-wide (1)")
    parser.add_argument("--data-dir", default="runs/click_logs", help="where the TFRecord files are written")
    parser.add_argument("--model-dir", default="runs/click_through", help="checkpoints, logs, TensorBoard")
    parser.add_argument(
        "--strategy",
        choices=["ps", "hybrid"],
        default="ps",
        help="everything on the PS, async; or hybrid: the sf.nn tables on the PS (async), the rest all-reduced (ps)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="seeds the dense layers' initial values and the shuffle, so that runs differ only by the timing of async "
        "updates (none: a new draw each run)",
    )
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()

import fcntl
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from summary import print_summary

import shardflow as sf
from shardflow import data
from shardflow.train.checkpoints import store

# Categorical features: (ids, embedding size). Item ids decide the category.
VOCABULARIES = {"user_id": (10_000, 16), "item_id": (2_000, 16), "category": (50, 8), "hour": (24, 4), "device": (3, 2)}
FEATURES = {
    **{name: data.FixedLenFeature([], np.int64) for name in VOCABULARIES},
    "position": data.FixedLenFeature([], np.float32),
    "click": data.FixedLenFeature([], np.int64),
}
# The large tables live only on the PS. The small ones stay torch.nn.Embedding, dense variables: every batch of 256
# touches most of their rows, so looking rows up and pushing them would move the tables whole anyway, whereas dense
# they come back with the pull every push gets (about 500 floats in all).
PS_TABLES = ("user_id", "item_id")
CROSS = "user_x_category"
"""The hashed cross feature: a row per (user, category) pair seen at least twice, in a DynamicEmbedding."""
CROSS_DIM = 8
BATCH_SIZE = 256


def generate_click_logs(directory: Path, num_train: int, seed: int = 0) -> dict[str, Any]:
    """Writes train-*.tfrecord and test-*.tfrecord (a fifth of num_train) once; returns what it wrote."""
    directory.mkdir(parents=True, exist_ok=True)
    meta_path = directory / "meta.json"
    # Every role runs this script: one process writes the files while the others wait for it.
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta["num_train"] != num_train:
                raise ValueError(
                    f"{directory} holds {meta['num_train']} training records, not --records {num_train}: "
                    "pass another --data-dir or delete it"
                )
            return meta
        rng = np.random.default_rng(seed)
        hidden = _hidden_model(rng)
        meta = {"num_train": num_train, "num_test": num_train // 5}
        for split, count, num_files in (("train", num_train, 8), ("test", meta["num_test"], 2)):
            logs, click_probability = _click_logs(rng, hidden, count)
            columns = [column.tolist() for column in logs.values()]
            records = [dict(zip(logs, values, strict=True)) for values in zip(*columns, strict=True)]
            for index in range(num_files):
                with data.TFRecordWriter(str(directory / f"{split}-{index:02d}.tfrecord")) as writer:
                    for record in records[index::num_files]:
                        writer.write(data.make_example(record))
            meta[f"{split}_click_rate"] = float(logs["click"].mean())
            meta[f"{split}_baseline_log_loss"] = _log_loss(logs["click"], meta["train_click_rate"])
            meta[f"{split}_oracle_log_loss"] = _log_loss(logs["click"], click_probability)
        meta_path.write_text(json.dumps(meta))
        return meta


def _hidden_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What makes people click, in the generator only: the model has to learn it from the logs."""
    num_users, num_items, num_categories = (VOCABULARIES[name][0] for name in ("user_id", "item_id", "category"))
    return {
        "user_bias": rng.normal(0, 0.5, num_users),
        "item_bias": rng.normal(0, 0.5, num_items),
        "item_category": rng.integers(0, num_categories, num_items),
        "category_bias": rng.normal(0, 0.8, num_categories),
        # How much each user likes each category: an interaction, which a sum of per-feature biases cannot fit.
        "user_taste": rng.normal(0, 0.7, (num_users, 4)),
        "category_style": rng.normal(0, 0.7, (num_categories, 4)),
        "hour_effect": 0.5 * np.sin(np.arange(24) / 24 * 2 * np.pi),
        "device_effect": np.array([0.0, -0.4, 0.3]),
    }


def _click_logs(rng: np.random.Generator, hidden: dict[str, np.ndarray], count: int) -> tuple[dict, np.ndarray]:
    users = _zipf(rng, VOCABULARIES["user_id"][0], count)
    items = _zipf(rng, VOCABULARIES["item_id"][0], count)
    categories = hidden["item_category"][items]
    hours = rng.integers(0, 24, count)
    devices = rng.choice(3, count, p=[0.6, 0.3, 0.1])
    positions = rng.integers(1, 6, count).astype(np.float32)
    logit = (
        -1.5
        + hidden["user_bias"][users]
        + hidden["item_bias"][items]
        + hidden["category_bias"][categories]
        + (hidden["user_taste"][users] * hidden["category_style"][categories]).sum(axis=1)
        + hidden["hour_effect"][hours]
        + hidden["device_effect"][devices]
        - 0.3 * (positions - 1)
    )
    probability = 1 / (1 + np.exp(-logit))
    logs = {
        "user_id": users,
        "item_id": items,
        "category": categories,
        "hour": hours,
        "device": devices,
        "position": positions,
        "click": (rng.random(count) < probability).astype(np.int64),
    }
    return logs, probability


def _zipf(rng: np.random.Generator, vocabulary_size: int, count: int, exponent: float = 1.1) -> np.ndarray:
    """Ids in [0, vocabulary_size) with P(k-th most frequent) proportional to 1 / k**exponent."""
    weights = 1 / np.arange(1, vocabulary_size + 1) ** exponent
    return rng.permutation(vocabulary_size)[rng.choice(vocabulary_size, count, p=weights / weights.sum())]


def _log_loss(clicks: np.ndarray, probability: np.ndarray | float) -> float:
    probability = np.clip(probability, 1e-7, 1 - 1e-7)
    return float(-np.mean(clicks * np.log(probability) + (1 - clicks) * np.log(1 - probability)))


def hash_cross(users: np.ndarray, categories: np.ndarray) -> np.ndarray:
    """Each (user, category) pair as one int64 id spread over all of int64, as a feature pipeline hashes a cross
    feature (splitmix64's finaliser of an exact pairing): no vocabulary, rows made only for the pairs that occur."""
    x = users.astype(np.uint64) * np.uint64(1 << 20) + categories.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).view(np.int64)


def parse(records: np.ndarray) -> dict[str, np.ndarray]:
    """A batch of serialized Examples as features, with the cross feature hashed here, in the input pipeline: the
    model then passes the batch's own tensor to its table, whose rows the worker can look up one step ahead."""
    features = data.parse_example(records, FEATURES)
    features[CROSS] = hash_cross(features["user_id"], features["category"])
    return features


class ClickModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Small initial rows: a rare id then starts near "no effect" instead of at a random one. Each PS draws the
        # rows it owns itself, seeded per row.
        small = sf.nn.Initializer(kind="normal", std=0.01)
        self.embeddings = torch.nn.ModuleDict()
        for name, (size, dim) in VOCABULARIES.items():
            if name in PS_TABLES:
                self.embeddings[name] = sf.nn.Embedding(size, dim, initializer=small)
            else:
                self.embeddings[name] = torch.nn.Embedding(size, dim)
                torch.nn.init.normal_(self.embeddings[name].weight, std=0.01)
        # Admission after 2 sightings: a pair seen once reads its initial values and gets no row, nor its gradient.
        self.embeddings[CROSS] = sf.nn.DynamicEmbedding(CROSS_DIM, admit_after=2, initializer=small)
        width = sum(dim for _, dim in VOCABULARIES.values()) + CROSS_DIM + 1
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        columns = [table(features[name]) for name, table in self.embeddings.items()]
        columns.append(features["position"].unsqueeze(1))
        return self.mlp(torch.cat(columns, dim=1)).squeeze(1)


def loss_fn(model: ClickModel, features: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(model(features), features["click"].float())


def auc(model: ClickModel, features: dict[str, torch.Tensor]) -> torch.Tensor:
    """Area under the ROC curve: the chance that a random click scores above a random non-click."""
    ranks = model(features).argsort().argsort().double() + 1
    clicked = features["click"].bool()
    num_clicks, num_others = clicked.sum(), (~clicked).sum()
    return (ranks[clicked].sum() - num_clicks * (num_clicks + 1) / 2) / (num_clicks * num_others)


def main(args: argparse.Namespace) -> None:
    data_dir = Path(args.data_dir)
    meta = generate_click_logs(data_dir, args.records)

    def input_fn(ctx: sf.InputContext) -> data.Dataset:
        files = data.Dataset.list_files(str(data_dir / "train-*.tfrecord"), shuffle=True, seed=0)
        files = data.auto_shard(files, ctx.num_workers, ctx.worker_index, data.AutoShardPolicy.FILE)
        return (
            files.interleave(data.TFRecordDataset, cycle_length=4, num_parallel_calls=data.AUTOTUNE)
            .shuffle(10_000, seed=None if args.seed is None else args.seed + ctx.worker_index)
            .batch(BATCH_SIZE)
            .map(parse, num_parallel_calls=data.AUTOTUNE)
            .prefetch(data.AUTOTUNE)
        )

    def eval_input_fn(ctx: sf.InputContext) -> data.Dataset:
        # One batch holding the whole test set, so that the AUC is over all of it, not a mean over batches.
        records = data.TFRecordDataset(sorted(str(path) for path in data_dir.glob("test-*.tfrecord")))
        return records.batch(meta["num_test"]).map(parse)

    if args.seed is not None:
        torch.manual_seed(args.seed)
    est = sf.Estimator(
        model_fn=ClickModel,
        loss_fn=loss_fn,
        optimizer=sf.optim.Adagrad(lr=0.05),
        strategy=(
            sf.HybridStrategy(num_ps=2, num_workers=2, sparse_mode="async")
            if args.strategy == "hybrid"
            else sf.ParameterServerStrategy(num_ps=2, num_workers=2, mode="async")
        ),
        model_dir=args.model_dir,
    )
    result = sf.train_and_evaluate(
        est,
        sf.TrainSpec(input_fn, epochs=args.epochs),
        sf.EvalSpec(eval_input_fn, metrics={"auc": auc}),
    )

    # A hybrid global step all-reduces a batch of every worker that had one.
    steps = max(result.global_step - result.start_step, 1)
    per_step = 1 if args.strategy == "ps" else sum(result.worker_steps.values()) / steps
    print_summary(
        f"click_through: embeddings + MLP on {meta['num_train']} generated click logs in {data_dir} "
        f"(click rate {meta['train_click_rate']:.1%}); "
        + (
            "async PS training" if args.strategy == "ps" else "hybrid training (tables on the PS, the rest all-reduced)"
        ),
        est,
        result,
        [
            f"test log-loss    {result.metrics['loss']:.4f}  (baseline, the training click rate for everyone: "
            f"{meta['test_baseline_log_loss']:.4f}; the generator's true probabilities: "
            f"{meta['test_oracle_log_loss']:.4f})",
            f"test AUC         {result.metrics['auc']:.3f}  (baseline 0.5)",
            f"examples/s       {result.global_steps_per_s * BATCH_SIZE * per_step:.0f}  (a global step is "
            + (
                f"one worker's batch of {BATCH_SIZE})"
                if per_step == 1
                else f"a batch of {BATCH_SIZE} from every worker)"
            ),
            *_table_lines(Path(result.checkpoint), result.ps_stats),
        ],
    )


def _table_lines(checkpoint: Path, ps_stats: dict[str, dict[str, Any]]) -> list[str]:
    """Where each embedding table's rows live: an sf.nn table's on each PS, as the PS count them; a dense table's
    as the checkpoint places it."""
    manifest = store.read_manifest(checkpoint)
    lines = []
    for name in [*VOCABULARIES, CROSS]:
        table = f"embeddings.{name}"
        if table in manifest["tables"]:
            lines.append(_sf_nn_line(name, manifest["tables"][table]["spec"], ps_stats))
            continue
        if manifest["placement"] is None:  # hybrid: every worker holds the dense variables, all-reduced
            size, dim = VOCABULARIES[name]
            lines.append(f"dense table      {name} {size}x{dim}: on every worker, all-reduced")
            continue
        slices = [p for p in manifest["placement"]["pieces"] if p["name"] == f"{table}.weight"]
        where = ", ".join(f"rows {p['rows'][0]}-{p['rows'][1]} on ps:{p['ps']}" for p in slices)
        lines.append(f"dense table      {name} {'x'.join(map(str, slices[0]['shape']))}: {where}")
    return lines


def _sf_nn_line(name: str, spec: dict[str, Any], ps_stats: dict[str, dict[str, Any]]) -> str:
    def counted(key: str) -> list[tuple[str, int]]:
        return [(ps, stats[f"table/{spec['name']}/{key}"]) for ps, stats in sorted(ps_stats.items())]

    held = ", ".join(f"{rows} rows on {ps}" for ps, rows in counted("rows"))
    if spec["num_embeddings"] is not None:
        shape = f"{spec['num_embeddings']}x{spec['embedding_dim']}"
        return f"sf.nn table      {name} {shape}, by id mod {len(ps_stats)}: {held}"
    admitted, rejected = (sum(count for _, count in counted(key)) for key in ("admitted", "rejected"))
    return (
        f"sf.nn table      {name} x{spec['embedding_dim']}, dynamic, hashed ids: {held}; {admitted} ids admitted "
        f"after {spec['admit_after']} sightings, {rejected} gradients of ids without a row dropped"
    )


if __name__ == "__main__":
    main(args)
