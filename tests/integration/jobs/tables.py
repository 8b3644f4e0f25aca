"""A job whose embeddings are `sf.nn` tables (they live only on the PS) for integration tests, configured by the
JSON file in argv[1]. The test imports it for the model and data of its one-process reference.

Worker w reads batches w, w + num_workers, ... of a fixed data set of id lookups, tag bags, hashed user ids and
targets; each record carries its number, so the audit can say which records were applied. With "audit", the model
has one more table, a row per record, zeros, trained with SGD at lr 1/16 on a loss term of -16 x that row: every
push of a record adds exactly 1.0 to its row, so the rows count how often each record was applied.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

import shardflow as sf

NUM_IDS, NUM_TAGS, DIM = 5_000, 100, 16


def make_data(num_batches: int, batch: int, num_ids: int = NUM_IDS) -> dict[str, torch.Tensor]:
    """Ids (3 per example, skewed so batches share rows), tags (a bag of 4), users (hashed 62-bit ids, Zipf-like)
    and targets."""
    generator = torch.Generator().manual_seed(11)
    count = num_batches * batch
    ids = (torch.rand(count, 3, generator=generator, dtype=torch.float64) ** 3 * num_ids).long()
    tags = torch.randint(0, NUM_TAGS, (count, 4), generator=generator)
    ranks = (torch.rand(count, generator=generator) ** 4 * 2_000).long()
    users = (ranks * 0x9E3779B97F4A7C1) & ((1 << 62) - 1)
    targets = 1 + 0.1 * torch.randn(count, 1, generator=generator)  # learnable: the loss falls
    return {"ids": ids, "tags": tags, "users": users, "targets": targets, "record": torch.arange(count)}


class Model(torch.nn.Module):
    def __init__(
        self, dynamic: bool = False, admit_after: int = 1, num_ids: int = NUM_IDS, audited_records: int = 0
    ) -> None:
        super().__init__()
        zeros = sf.nn.Initializer(kind="zeros")
        self.audit = (
            sf.nn.Embedding(audited_records, 1, initializer=zeros, optimizer=sf.nn.sgd(1 / 16))
            if audited_records
            else None
        )
        self.ids = sf.nn.Embedding(num_ids, DIM)
        self.tags = sf.nn.EmbeddingBag(NUM_TAGS, 4, mode="mean")
        self.users = sf.nn.DynamicEmbedding(4, admit_after=admit_after) if dynamic else None
        width = DIM + 4 + (4 if dynamic else 0)
        self.head = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.ids(batch["ids"]).mean(dim=1), self.tags(batch["tags"])]
        if self.users is not None:
            parts.append(self.users(batch["users"]))
        return self.head(torch.cat(parts, dim=1))


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(batch), batch["targets"])
    audit = model.audit if isinstance(model, Model) else None
    if audit is not None:  # adds 1.0 to each record's row per push of it
        loss = loss - 16 * audit(batch["record"]).sum()
    return loss


class EndLog(sf.Hook):
    """A line per call of a worker's `end` hook: its role and the global step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def end(self, info: sf.StepInfo) -> None:
        with open(self.path, "a") as log:
            log.write(f"{info.role} {info.global_step}\n")


def main(config: dict[str, Any]) -> None:
    num_batches, batch = config.get("num_batches", 40), config.get("batch", 8)
    num_ids = config.get("num_ids", NUM_IDS)
    data = make_data(num_batches, batch, num_ids)
    dynamic, admit_after = config.get("dynamic", False), config.get("admit_after", 1)

    def input_fn(ctx: sf.InputContext):
        for b in range(ctx.worker_index, num_batches, ctx.num_workers):
            yield {key: value[b * batch : (b + 1) * batch] for key, value in data.items()}

    optimizer = getattr(sf.optim, config.get("optimizer", "Adagrad"))(lr=config.get("lr", 0.1))
    strategy: sf.ParameterServerStrategy | sf.HybridStrategy
    if config.get("strategy") == "hybrid":  # the tables on the PS, the head all-reduced
        strategy = sf.HybridStrategy(
            num_ps=config.get("num_ps", 2),
            num_workers=config.get("num_workers", 2),
            sparse_mode=config.get("mode", "sync"),
            gradient_accumulation_steps=config.get("accumulation", 1),
            max_restarts=config.get("max_restarts", 0),
            restart_backoff_s=0.1,
        )
    else:
        strategy = sf.ParameterServerStrategy(
            num_ps=config.get("num_ps", 2),
            num_workers=config.get("num_workers", 2),
            mode=config.get("mode", "sync"),
            gradient_accumulation_steps=config.get("accumulation", 1),
            max_nonfinite_updates=config.get("max_nonfinite_updates", 1),
        )

    def model_fn() -> Model:
        torch.manual_seed(0)
        return Model(dynamic, admit_after, num_ids, num_batches * batch if config.get("audit") else 0)

    nan_rows_at = config.get("nan_rows_at")
    """A batch (by its first record) whose ids' rows get NaN gradients while its loss stays finite."""

    def checked_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(config.get("step_delay_s", 0))
        if config.get("step_log"):  # one line per batch: a test waits for training to be under way
            with open(config["step_log"], "a") as log:
                log.write("step\n")
        if nan_rows_at is None or int(batch["record"][0]) != nan_rows_at:
            return loss_fn(model, batch)
        rows = model.ids(batch["ids"])
        # where() picks the finite branch forward, but backward sends 0 * inf = NaN into the other's rows.
        poisoned = torch.where(torch.ones_like(rows, dtype=torch.bool), rows, rows * float("inf"))
        out = model.head(torch.cat([poisoned.mean(dim=1), model.tags(batch["tags"])], dim=1))
        return torch.nn.functional.mse_loss(out, batch["targets"])

    est = sf.Estimator(
        model_fn,
        checked_loss,
        optimizer,
        strategy,
        config["model_dir"],
        save_checkpoints_steps=config.get("save_checkpoints_steps"),
        clip_grad_norm=config.get("clip_grad_norm"),
        profile_steps=tuple(config["profile_steps"]) if "profile_steps" in config else None,
    )
    hooks = [EndLog(config["end_log"])] if config.get("end_log") else []
    train_spec = sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=config.get("epochs", 1), hooks=hooks)
    eval_spec = None
    if config.get("eval_every_secs"):  # the chief evaluates the first 10 batches this often while training

        def eval_input_fn(ctx: sf.InputContext):
            for b in range(10):
                yield {key: value[b * batch : (b + 1) * batch] for key, value in data.items()}

        eval_spec = sf.EvalSpec(eval_input_fn, every_n_secs=config["eval_every_secs"])
    result = sf.train_and_evaluate(est, train_spec, eval_spec)
    with open(config["result"], "w") as f:
        fields = ("global_step", "start_step", "first_loss", "final_loss", "ps_stats", "checkpoint", "eval_history")
        json.dump({name: getattr(result, name) for name in fields}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
