"""Click-through with a 10M-row embedding table living only on the PS, side by side with its peers in one run.

The model of click_model.py (item table 10M x 16, Zipf-like ids; category and tag tables; MLP head), Adagrad,
batch 512 per worker step, alternating repeats, best against best:
- async 2 workers + 2 PS vs TensorFlow ParameterServerStrategy, 2 workers + 2 PS, the item table sharded over the
  PS (target >= 3x examples/s), and 1 worker + 1 PS against TensorFlow's 1 worker + 1 PS (the setup that fits a
  machine of 2 cores: 2 workers + 2 PS with the chief and TensorFlow's coordinator are 6 busy processes on it);
- 1 worker + 1 PS (target >= 0.7x) and 2 workers + 2 PS (target >= 1.2x) vs the one-process PyTorch loop with
  torch.nn.Embedding(sparse=True) tables and torch.optim.Adagrad;
- also: rows looked up per second per PS, bytes a worker step moves, PS memory per row with Adagrad's state.

Usage: python benchmarks/embedding_tables.py [--steps N] [--tf-steps N] [--local-steps N] [--repeats R] [--no-tf]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import click_model as cm
import torch
from ps_training import run_json
from result_line import print_result, row

HERE = Path(__file__).parent
warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad's sparse path, each step
# Every run ends with a checkpoint of the 10M rows and their Adagrad state (1.3 GB), outside the measured training
# time: written to memory where the machine has a tmpfs, it adds seconds to a run instead of tens of seconds.
MEMORY_DIR = Path("/dev/shm")
TMPDIR = {"TMPDIR": str(MEMORY_DIR)} if MEMORY_DIR.is_dir() else {}


class LocalLoop:
    """The one-process PyTorch loop: the same tables as torch.nn.Embedding(sparse=True) and EmbeddingBag, the same
    head, torch.optim.Adagrad on both (its sparse path on the tables), the same batches."""

    def __init__(self) -> None:
        self.default_threads = torch.get_num_threads()
        torch.manual_seed(0)
        self.item = torch.nn.Embedding(cm.NUM_ITEMS, cm.ITEM_DIM, sparse=True)
        self.category = torch.nn.Embedding(cm.NUM_CATEGORIES, cm.CATEGORY_DIM, sparse=True)
        self.tags = torch.nn.EmbeddingBag(cm.NUM_TAGS, cm.TAG_DIM, mode="mean", sparse=True)
        tables = [self.item.weight, self.category.weight, self.tags.weight]
        with torch.no_grad():
            for weight in tables:
                weight.uniform_(cm.INIT_LOW, cm.INIT_HIGH)
        self.head = cm.torch_head()
        adagrad = {"lr": cm.LR, "initial_accumulator_value": cm.INITIAL_ACCUMULATOR, "eps": cm.EPS}
        self.optimizers = [
            torch.optim.Adagrad(tables, **adagrad),
            torch.optim.Adagrad(self.head.parameters(), **adagrad),
        ]
        self.batches = cm.torch_batches(0)

    def step(self, i: int) -> None:
        batch = self.batches[i % len(self.batches)]
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        features = [
            self.item(batch["item"]),
            self.category(batch["category"]),
            self.tags(batch["tags"]),
            batch["dense"],
        ]
        logits = self.head(torch.cat(features, dim=1)).squeeze(1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["click"]).backward()
        for optimizer in self.optimizers:
            optimizer.step()

    def steps_per_s(self, steps: int) -> float:
        """At its best: with torch's default threads (one per core) or one thread, whichever is faster over 50
        steps (on a loaded machine, threads that wait for each other at every op can cost 10x)."""
        rates = {}
        for threads in (self.default_threads, 1):
            torch.set_num_threads(threads)
            rates[threads] = self._timed(50)
        torch.set_num_threads(max(rates, key=rates.__getitem__))
        return self._timed(steps)

    def _timed(self, steps: int) -> float:
        for i in range(10):
            self.step(i)
        started = time.perf_counter()
        for i in range(steps):
            self.step(i)
        return steps / (time.perf_counter() - started)


def shardflow_job(workers: int, ps: int, steps: int) -> dict:
    return run_json([str(HERE / "jobs" / "click_through.py"), str(workers), str(ps), str(steps)], TMPDIR)


def tf_job(workers: int, ps: int, steps: int) -> dict:
    return run_json([str(HERE / "peers" / "tf_embedding.py"), str(workers), str(ps), str(steps)])


def per_step(run: dict, ids: dict[str, float] | None = None) -> dict[str, float]:
    """What a worker step moves and looks up, from the unique ids per table per PS the job counted in its click
    logs (or, with `ids`, as many rows per table as that: every id of the batch, none de-duplicated). Sent: the
    lookups' ids, the gradient rows with their ids and counts, the dense gradients; received: the rows and the
    dense parameters. Message headers are left out (a few hundred bytes)."""
    dims = {"item": cm.ITEM_DIM, "category": cm.CATEGORY_DIM, "tags": cm.TAG_DIM}
    unique = {name: sum(per_ps) for name, per_ps in run["unique_ids_per_step"].items()}
    rows = ids or unique
    dense = 4 * sum(p.numel() for p in cm.torch_head().parameters())
    sent = sum(n * (8 + 8 + 8 + 4 * dims[name]) for name, n in rows.items()) + dense
    received = sum(n * 4 * dims[name] for name, n in rows.items()) + dense
    num_ps = len(next(iter(run["unique_ids_per_step"].values())))
    return {"bytes": sent + received, "rows_per_ps": sum(rows.values()) / num_ps}


def memory_per_row(run: dict, table: str = "item") -> float:
    """Bytes a PS holds per row of `table`, its optimizer's state included (the PS's own count, summed over them)."""
    stats = run["ps_stats"].values()
    return sum(s[f"table/{table}/memory_bytes"] for s in stats) / sum(s[f"table/{table}/rows"] for s in stats)


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["steps_per_s"])


def measure(args: argparse.Namespace) -> dict[str, list]:
    """Every setting once per repeat, in turn."""
    runs: dict[str, list] = {"local": [], "sf_1w1ps": [], "sf_2w2ps": [], "tf_1w1ps": [], "tf_2w2ps": []}
    local = LocalLoop()
    for _ in range(args.repeats):
        runs["local"].append({"steps_per_s": local.steps_per_s(args.local_steps)})
        for name, (workers, ps) in (("sf_1w1ps", (1, 1)), ("sf_2w2ps", (2, 2))):
            result = shardflow_job(workers, ps, args.steps)
            if result["global_step"] != args.steps:
                raise RuntimeError(f"shardflow's {name} job ended at global step {result['global_step']}")
            runs[name].append(result)
        if not args.no_tf:
            runs["tf_1w1ps"].append(tf_job(1, 1, args.tf_steps))
            runs["tf_2w2ps"].append(tf_job(2, 2, args.tf_steps))
        print(", ".join(f"{name} {r[-1]['steps_per_s'] * cm.BATCH:,.0f}" for name, r in runs.items() if r), flush=True)
    del local
    return runs


def summarise(runs: dict[str, list]) -> dict:
    examples = {name: [r["steps_per_s"] * cm.BATCH for r in results] for name, results in runs.items()}
    sf_1w, sf_2w = best(runs["sf_1w1ps"]), best(runs["sf_2w2ps"])
    batch_ids = {"item": cm.BATCH, "category": cm.BATCH, "tags": cm.BATCH * cm.TAGS_PER_EXAMPLE}
    result = {
        "batch": cm.BATCH,
        "examples_per_s": examples,
        "best_examples_per_s": {name: max(values) for name, values in examples.items() if values},
        "sf_2w2ps_worker_steps": sf_2w["worker_steps"],
        "sf_loss_first_final": [sf_2w["first_loss"], sf_2w["final_loss"]],
        "unique_ids_per_step_per_ps": sf_2w["unique_ids_per_step"],
        "lookups_per_s_per_ps": {
            name: per_step(run)["rows_per_ps"] * run["steps_per_s"]
            for name, run in (("1w1ps", sf_1w), ("2w2ps", sf_2w))
        },
        "bytes_per_worker_step": per_step(sf_2w)["bytes"],
        "bytes_per_worker_step_every_id": per_step(sf_2w, batch_ids)["bytes"],
        "ps_bytes_per_item_row": memory_per_row(sf_2w),
        "ps_apply_s": {ps: stats["apply_s"] for ps, stats in sf_2w["ps_stats"].items()},
        "training_s": sf_2w["training_s"],
    }
    best_of = result["best_examples_per_s"]
    result["ratio_1w1ps_vs_local"] = best_of["sf_1w1ps"] / best_of["local"]
    result["ratio_2w2ps_vs_local"] = best_of["sf_2w2ps"] / best_of["local"]
    if "tf_2w2ps" in best_of:
        result["ratio_2w2ps_vs_tf"] = best_of["sf_2w2ps"] / best_of["tf_2w2ps"]
        result["ratio_1w1ps_vs_tf"] = best_of["sf_1w1ps"] / best_of["tf_1w1ps"]
    return result


def result_rows(result: dict) -> list[dict]:
    """BENCHMARKS.md's rows: examples/s against TF and the local loop, then the table's own figures."""
    best_of, rows = result["best_examples_per_s"], []
    measure = "click-through, 10M-row table: async 2 workers + 2 PS, examples/s"
    if "tf_2w2ps" in best_of:
        peer = "TF ParameterServerStrategy 2 workers + 2 PS, sharded table"
        rows.append(row(measure, best_of["sf_2w2ps"], peer, best_of["tf_2w2ps"], target=">= 3"))
    local = "one-process PyTorch loop, nn.Embedding(sparse=True)"
    rows.append(row(measure, best_of["sf_2w2ps"], local, best_of["local"], target=">= 1.2"))
    measure = "click-through, 10M-row table: async 1 worker + 1 PS, examples/s"
    if "tf_1w1ps" in best_of:
        peer = "TF ParameterServerStrategy 1 worker + 1 PS"
        rows.append(row(measure, best_of["sf_1w1ps"], peer, best_of["tf_1w1ps"], target=">= 3"))
    rows.append(row(measure, best_of["sf_1w1ps"], local, best_of["local"], target=">= 0.7"))
    lookups = result["lookups_per_s_per_ps"]
    measure = "rows looked up per second per PS, 2 workers + 2 PS"
    rows.append(row(measure, lookups["2w2ps"], "the same job, 1 worker + 1 PS", lookups["1w1ps"]))
    measure = "bytes per worker step, sent + received (unique ids' rows, dense head)"
    peer = "the same batches, every id's row (no de-duplication)"
    rows.append(row(measure, result["bytes_per_worker_step"], peer, result["bytes_per_worker_step_every_id"]))
    measure = "PS bytes per row of the 10M x 16 table, Adagrad state included"
    rows.append(row(measure, result["ps_bytes_per_item_row"], "the row's values alone", 4 * cm.ITEM_DIM))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="global steps of each shardflow job")
    parser.add_argument("--tf-steps", type=int, default=600, help="timed steps of each TensorFlow run")
    parser.add_argument("--local-steps", type=int, default=1000, help="timed steps of the local loop")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-tf", action="store_true", help="skip the TensorFlow peer")
    args = parser.parse_args()
    result = summarise(measure(args))
    print(f"{'run':34} {'examples/s (each repeat)':>40}")
    for name, values in result["examples_per_s"].items():
        print(f"{name:34} {', '.join(f'{v:,.0f}' for v in values):>40}")
    print(f"1 worker + 1 PS vs local loop: {result['ratio_1w1ps_vs_local']:.2f}x (target >= 0.7x)")
    print(f"2 workers + 2 PS vs local loop: {result['ratio_2w2ps_vs_local']:.2f}x (target >= 1.2x)")
    if "ratio_2w2ps_vs_tf" in result:
        print(f"2 workers + 2 PS vs TF: {result['ratio_2w2ps_vs_tf']:.2f}x (target >= 3x)")
        print(f"1 worker + 1 PS vs TF 1 worker + 1 PS: {result['ratio_1w1ps_vs_tf']:.2f}x (target >= 3x)")
    lookups = result["lookups_per_s_per_ps"]
    print(f"rows looked up per second per PS: {lookups['2w2ps']:,.0f} (2w+2PS), {lookups['1w1ps']:,.0f} (1w+1PS)")
    print(f"bytes per worker step: {result['bytes_per_worker_step']:,.0f}")
    print(f"PS bytes per item row: {result['ps_bytes_per_item_row']:.1f}")
    print_result("embedding_tables", result, result_rows(result))


if __name__ == "__main__":
    main()
