"""A job for checkpoint, epoch and evaluation tests, configured by the JSON file in argv[1].

The input is a real shardflow.data pipeline (text files of record ids, FILE-sharded across workers,
shuffled and batched); each worker logs the ids of every batch it trains on.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

import shardflow as sf
from shardflow import data
from shardflow.train.checkpoints import store

with open(sys.argv[1]) as f:
    config = json.load(f)
FILES = sorted(Path(config["data_dir"]).glob("part-*.txt"))
TASK = json.loads(os.environ.get("SHARDFLOW_CLUSTER", "{}")).get("task", {})
features = np.random.default_rng(7).standard_normal((config["num_records"], 4)).astype(np.float32)
targets = features @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)


def input_fn(ctx: sf.InputContext):
    files = data.Dataset.list_files([str(f) for f in FILES], shuffle=False)
    files = data.auto_shard(files, ctx.num_workers, ctx.worker_index, data.AutoShardPolicy.FILE)
    ids = files.interleave(data.TextLineDataset, cycle_length=2).map(lambda line: np.int64(int(line)))
    return ids.shuffle(32, seed=5).batch(config.get("batch", 4))


def eval_input_fn(ctx: sf.InputContext):
    ids = np.arange(64)
    yield torch.from_numpy(features[ids]), torch.from_numpy(targets[ids]), ids


def loss_fn(model, batch):
    if len(batch) == 3:
        x, y, _ = batch
    else:
        ids = batch.numpy()
        if config.get("batch_log"):
            with open(f"{config['batch_log']}.{TASK.get('index')}", "a") as f:
                f.write(json.dumps(ids.tolist()) + "\n")
        x, y = torch.from_numpy(features[ids]), torch.from_numpy(targets[ids])
    return torch.nn.functional.mse_loss(model(x), y)


def full_disk_at(steps: list[int]) -> None:
    """The disk is full while the chief saves these steps: safetensors raises what it raises then."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    def failing(
        tensors: dict[str, torch.Tensor], filename: str | os.PathLike, metadata: dict[str, str] | None = None
    ) -> None:
        if any(f"ckpt-{step:09d}" in str(filename) for step in steps):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename, metadata)

    store.save_file = failing  # type: ignore[attr-defined]


if config.get("full_disk_at"):
    full_disk_at(config["full_disk_at"])


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


strategy = sf.ParameterServerStrategy(
    num_ps=config.get("num_ps", 2),
    num_workers=config.get("num_workers", 2),
    mode=config.get("mode", "sync"),
    evaluator=config.get("evaluator", False),
    partitioner=sf.Partitioner(min_slice_bytes=config.get("min_slice_bytes", 256 << 10)),
)
est = sf.Estimator(
    model_fn,
    loss_fn,
    sf.optim.Adam(lr=1e-2),
    strategy,
    config["model_dir"],
    save_checkpoints_steps=config.get("save_checkpoints_steps"),
    keep_checkpoint_max=config.get("keep_checkpoint_max", 5),
)
eval_spec = None
if config.get("eval_every_n_steps"):
    stopping = config.get("early_stopping")
    eval_spec = sf.EvalSpec(
        eval_input_fn,
        every_n_steps=config["eval_every_n_steps"],
        early_stopping=sf.EarlyStopping(**stopping) if stopping else None,
    )
elif config.get("evaluator"):
    eval_spec = sf.EvalSpec(eval_input_fn)
result = sf.train_and_evaluate(
    est, sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=config.get("epochs")), eval_spec
)
with open(config["result"], "w") as f:
    json.dump(
        {
            "global_step": result.global_step,
            "start_step": result.start_step,
            "worker_steps": result.worker_steps,
            "metrics": result.metrics,
            "eval_history": result.eval_history,
            "stopped_early": result.stopped_early,
            "failed_checkpoint_saves": result.failed_checkpoint_saves,
        },
        f,
    )
