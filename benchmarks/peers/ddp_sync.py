"""Peer: PyTorch DistributedDataParallel with gloo on localhost, W processes, MLP 64-512-512-10, batch 32 per
process, SGD: synchronous data parallelism without parameter servers.

Usage: python ddp_sync.py RESULT_JSON WORKERS STEPS
Writes the steps/s of STEPS timed steps after 50 untimed ones; one step is one batch on every process, as one
global step of shardflow's sync mode is.
"""

import json
import multiprocessing
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp import BATCH, NUM_EXAMPLES, mlp, synthetic_data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(rank: int, world: int, port: int, steps: int, results: "multiprocessing.Queue[float]") -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The cores shared among the processes, as shardflow's launcher shares them among its roles.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_data(torch.Generator().manual_seed(rank))

    def step(i: int) -> None:
        j = (i * BATCH) % NUM_EXAMPLES
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[j : j + BATCH]), y[j : j + BATCH]).backward()
        optimizer.step()

    for i in range(50):
        step(i)
    dist.barrier()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    dist.barrier()
    if rank == 0:
        results.put(steps / (time.perf_counter() - started))
    dist.destroy_process_group()


def main() -> None:
    result_path, world, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=run, args=(rank, world, port, steps, results)) for rank in range(world)]
    for p in processes:
        p.start()
    try:
        steps_per_s = results.get(timeout=600)
    finally:
        for p in processes:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    with open(result_path, "w") as f:
        json.dump({"steps_per_s": steps_per_s, "workers": world, "steps": steps}, f)


if __name__ == "__main__":
    main()
