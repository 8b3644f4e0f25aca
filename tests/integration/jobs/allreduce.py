"""The regression job of regression.py trained with sf.AllReduceStrategy, or with ParameterServerStrategy in sync
mode (`"strategy": "ps"`), so that one model directory can go from one strategy to the other; configured by a JSON
file given as argv[1].

Worker w reads batches w, w + num_workers, ... of a fixed regression data set."""

import json
import sys
import time

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_BATCHES = config.get("num_batches", 100)
BATCH = config.get("batch", 8)
generator = torch.Generator().manual_seed(123)
X = torch.randn(NUM_BATCHES * BATCH, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(NUM_BATCHES * BATCH, 1, generator=generator)


def input_fn(ctx: sf.InputContext):
    for b in range(ctx.worker_index, NUM_BATCHES, ctx.num_workers):
        yield X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(model, batch):
    x, y = batch
    time.sleep(config.get("step_delay_s", 0))
    out = model(x)
    if config.get("step_log"):  # one line per batch (a test waits for training to be under way), with its dtype
        with open(config["step_log"], "a") as log:
            log.write(f"step {out.dtype}\n")
    return torch.nn.functional.mse_loss(out.float(), y)


num_workers = config.get("num_workers", 2)
strategy: sf.ParameterServerStrategy | sf.AllReduceStrategy
if config.get("strategy", "allreduce") == "ps":
    strategy = sf.ParameterServerStrategy(num_ps=config.get("num_ps", 1), num_workers=num_workers, mode="sync")
else:
    strategy = sf.AllReduceStrategy(
        num_workers=num_workers,
        bucket_bytes=config.get("bucket_bytes", 25 * 2**20),
        max_restarts=config.get("max_restarts", 0),  # a lost worker fails the job unless a test asks otherwise
        restart_backoff_s=config.get("restart_backoff_s", 1.0),
        request_timeout_s=config.get("request_timeout_s", 60.0),
        worker_rejoin_timeout_s=config.get("worker_rejoin_timeout_s", 120.0),
        mixed_precision=config.get("mixed_precision"),
        gradient_accumulation_steps=config.get("accumulation", 1),
        evaluator=config.get("evaluator", False),
        device=config.get("device"),
    )
optimizers = {"sgd": sf.optim.SGD(lr=config.get("lr", 0.05)), "adam": sf.optim.Adam(lr=config.get("lr", 0.05))}
est = sf.Estimator(
    model_fn,
    loss_fn,
    optimizers[config.get("optimizer", "sgd")],
    strategy,
    config["model_dir"],
    save_checkpoints_steps=config.get("save_checkpoints_steps"),
    keep_checkpoint_max=None,
)
eval_spec = None
if config.get("eval_every") is not None or config.get("eval_every_secs") is not None:
    # Evaluated on worker:0's first 4 batches; early stopping once the loss stops falling by min_delta.
    stopping = config.get("early_stopping_min_delta")
    eval_spec = sf.EvalSpec(
        lambda ctx: input_fn(sf.InputContext(2, 0)),
        steps=4,
        every_n_steps=config.get("eval_every"),
        every_n_secs=config.get("eval_every_secs"),
        early_stopping=sf.EarlyStopping(patience=1, min_delta=stopping) if stopping is not None else None,
    )


class StopWorker1(sf.Hook):
    """Asks worker:1 to stop after `stop_worker_1_after` of its steps."""

    def after_step(self, info: sf.StepInfo) -> None:
        if info.worker_index == 1 and info.local_step >= config["stop_worker_1_after"]:
            info.request_stop()


hooks = [StopWorker1()] if config.get("stop_worker_1_after") else []
train_spec = sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=config.get("epochs"), hooks=hooks)
try:
    trained = sf.train_and_evaluate(est, train_spec, eval_spec)
except sf.Preempted as preempted:
    trained = preempted.result
with open(config["result"], "w") as f:
    json.dump(
        {
            "global_step": trained.global_step,
            "start_step": trained.start_step,
            "worker_steps": trained.worker_steps,
            "checkpoint": trained.checkpoint,
            "metrics": trained.metrics,
            "eval_steps": [entry["global_step"] for entry in trained.eval_history],
            "stopped_early": trained.stopped_early,
            "preempted": trained.preempted,
            "first_loss": trained.first_loss,
            "final_loss": trained.final_loss,
            "state_dict": {name: value.tolist() for name, value in est.state_dict().items()},
        },
        f,
    )
if trained.preempted:
    sys.exit(143)
