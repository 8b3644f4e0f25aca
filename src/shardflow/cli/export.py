"""Write the latest (or a chosen) checkpoint's parameters as a plain safetensors state_dict."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "example:\n  shardflow export runs/clicks model.safetensors\n"
        "then, in PyTorch: model.load_state_dict(safetensors.torch.load_file('model.safetensors'))"
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="the Estimator's model_dir")
    parser.add_argument("output", type=Path, metavar="OUT.safetensors", help="file to write")
    parser.add_argument("--checkpoint", metavar="NAME", help="a checkpoint under MODEL_DIR/checkpoints (the latest)")


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from shardflow.train.checkpoints import store

    where = store.directory(args.model_dir)
    if args.checkpoint:
        path = store.named(args.model_dir, args.checkpoint)
        if path is None:
            print(f"shardflow export: no checkpoint {args.checkpoint!r} in {where}", file=sys.stderr)
            return 2
    else:
        path = store.latest(args.model_dir)
        if path is None:
            print(f"shardflow export: no checkpoint in {where}; train first", file=sys.stderr)
            return 2
    state, _ = store.load_state(path)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in state.params.items()},
        str(args.output),
        metadata={"global_step": str(state.step)},
    )
    print(f"wrote {len(state.params)} tensors from {path.name} (global step {state.step}) to {args.output}")
    return 0
