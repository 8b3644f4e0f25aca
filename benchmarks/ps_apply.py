"""A PS's apply of one update to a 6.3M-parameter shard, with the threads it takes from its cores against 1 thread.

The shard is the dense GPU model's (MLP 1024-2048-2048-10), applied as the PS applies it: torch.optim's step over
the shard's variables with their gradients set, SGD and Adam; 1 thread and N alternate step by step. The default N
is every core this process may use (a PS alone on its machine); on a machine shared with other work, threads beyond
the free cores cost more than they give.

Usage: python benchmarks/ps_apply.py [--threads N] [--repeats R]   (default N: every core this process may use)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from result_line import print_result, row

from shardflow.train.ps_role import available_cores

SHAPES = [(2048, 1024), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]
OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def apply_ms(optimizer_name: str, threads: int, repeats: int) -> tuple[float, float]:
    """The median milliseconds of one optimizer step over the shard on 1 thread and on `threads`, alternating step
    by step so that both see the same load on a shared machine."""
    optimizers = []
    for _ in range(2):
        params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
        for param in params:
            param.grad = torch.randn(param.shape)
        optimizers.append(OPTIMIZERS[optimizer_name](params))
    times: dict[int, list[float]] = {1: [], threads: []}
    for i in range(repeats + 5):
        for count, optimizer in zip((1, threads), optimizers, strict=True):
            torch.set_num_threads(count)
            started = time.perf_counter()
            optimizer.step()
            if i >= 5:  # the first steps allocate the optimizer's state
                times[count].append(time.perf_counter() - started)
    return statistics.median(times[1]) * 1000, statistics.median(times[threads]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    num_parameters = sum(torch.Size(shape).numel() for shape in SHAPES)
    figures: dict[str, float] = {"parameters": num_parameters, "threads": args.threads}
    rows = []
    for name in OPTIMIZERS:
        one, many = apply_ms(name, args.threads, args.repeats)
        figures[f"{name}_ms_1_thread"], figures[f"{name}_ms_{args.threads}_threads"] = one, many
        print(f"{name} on {num_parameters:,} parameters: {one:.2f} ms on 1 thread, {many:.2f} ms on {args.threads}")
        measure = f"PS apply, {name} on 6.3M parameters, {args.threads} threads, updates/s"
        rows.append(row(measure, 1000 / many, "the same on 1 thread (a PS before issue 21)", 1000 / one))
    print_result("ps_apply", figures, rows)


if __name__ == "__main__":
    main()
