"""A real training job whose input_fn does not shard its input: each worker auto-shards it. The model counts how many
times each record's gradient was applied, as audit.py's does. Configured by a JSON file given as argv[1]:

- `source`: "files" (list_files of the TFRecord files at `pattern`, each record an int64 id), "tensors"
  (from_tensor_slices of the ids), or "glob" (a generator over the files `pattern` matches, which may be none);
- `policy`: an AutoShardPolicy name set in the pipeline's options; `allow_empty_input`, `epochs`, `max_steps`,
  `num_workers`, `num_records`, `batch`.
"""

import glob
import json
import sys

import numpy as np
import torch

import shardflow as sf
from shardflow import data

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_RECORDS = config.get("num_records", 96)
BATCH = config.get("batch", 8)
LR = 1.0 / 16


def parse(record: bytes) -> np.ndarray:
    return np.frombuffer(record, dtype=np.int64)[0]


def input_fn(ctx: sf.InputContext):
    source = config["source"]
    if source == "glob":
        return (parse_batch(path) for path in glob.glob(config["pattern"]))
    if source == "files":
        files = data.Dataset.list_files(config["pattern"])
        records = files.interleave(data.TFRecordDataset, cycle_length=2).map(parse)
    else:
        records = data.Dataset.from_tensor_slices(np.arange(NUM_RECORDS, dtype=np.int64))
    pipeline = records.shuffle(32).batch(BATCH)
    if config.get("policy"):
        options = data.Options()
        options.experimental_distribute.auto_shard_policy = data.AutoShardPolicy[config["policy"]]
        pipeline = pipeline.with_options(options)
    return pipeline


def parse_batch(path: str) -> torch.Tensor:
    return torch.as_tensor(np.array([parse(record) for record in data.TFRecordDataset(path)]))


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.nn.Parameter(torch.zeros(NUM_RECORDS))


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # Each applied gradient of a record adds exactly 1.0 to its counter (SGD at lr 1/16).
    seen: torch.Tensor = model.seen  # type: ignore[assignment]
    return -seen[ids].sum() / LR


est = sf.Estimator(
    Counted,
    loss_fn,
    sf.optim.SGD(lr=LR),
    sf.ParameterServerStrategy(num_ps=1, num_workers=config.get("num_workers", 2), mode="async"),
    config["model_dir"],
    save_summary_steps=config.get("save_summary_steps", 100),
)
spec = sf.TrainSpec(
    input_fn,
    epochs=config.get("epochs"),
    max_steps=config.get("max_steps"),
    allow_empty_input=config.get("allow_empty_input", False),
)
result = sf.train_and_evaluate(est, spec)
seen = est.state_dict()["seen"]
with open(config["result"], "w") as f:
    json.dump({"global_step": result.global_step, "seen": seen.tolist(), "worker_steps": result.worker_steps}, f)
