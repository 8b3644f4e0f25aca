"""A small real job written as a plain PyTorch user would: a module instance, a torch.optim class and a
torch.optim.lr_scheduler class, with clipping, gradient accumulation, mixed precision and summaries as the JSON
file given as argv[1] asks. Worker w reads batches w, w + num_workers, ...; the result holds the trained values."""

import functools
import json
import sys

import torch

import shardflow as sf

with open(sys.argv[1]) as f:
    config = json.load(f)
NUM_BATCHES = config["num_batches"]
BATCH = config.get("batch", 8)
generator = torch.Generator().manual_seed(123)
X = torch.randn(NUM_BATCHES * BATCH, 4, generator=generator)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(NUM_BATCHES * BATCH, 1, generator=generator)


def input_fn(ctx: sf.InputContext):
    for b in range(ctx.worker_index, NUM_BATCHES, ctx.num_workers):
        yield X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH]


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
schedule = config.get("lr_schedule")
est = sf.Estimator(
    net,
    loss_fn,
    functools.partial(torch.optim.SGD, lr=config.get("lr", 0.1)),
    sf.ParameterServerStrategy(
        num_ps=config.get("num_ps", 1),
        num_workers=config.get("num_workers", 2),
        mode=config.get("mode", "sync"),
        gradient_accumulation_steps=config.get("gradient_accumulation_steps", 1),
        mixed_precision=config.get("mixed_precision"),
    ),
    config["model_dir"],
    lr_schedule=functools.partial(getattr(torch.optim.lr_scheduler, schedule["name"]), **schedule["kwargs"])
    if schedule
    # A function of the step (the workers evaluate it; the PS apply what each push carries).
    else functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: min(1.0, (step + 1) / warm_up))
    if (warm_up := config.get("lr_warm_up_steps"))
    else None,
    clip_grad_norm=config.get("clip_grad_norm"),
    clip_grad_value=config.get("clip_grad_value"),
    save_summary_steps=config.get("save_summary_steps", 100),
)
result = sf.train_and_evaluate(est, sf.TrainSpec(input_fn, max_steps=config.get("max_steps"), epochs=1))
with open(config["result"], "w") as f:
    params = {name: value.tolist() for name, value in est.state_dict().items()}
    json.dump({"global_step": result.global_step, "params": params}, f)
