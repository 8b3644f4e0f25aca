"""What every example prints at the end, in the chief: what training did and where its outputs are."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported here: the script that imports this module imports shardflow itself, after torch
    import shardflow as sf


def write_profile_report(capture: Path) -> Path:
    """The HTML report of a capture, beside its merged trace."""
    from shardflow.profile.capture import finalize
    from shardflow.profile.events import load
    from shardflow.profile.report import write_report

    return write_report(load(finalize(capture)), capture / "report.html", title=f"shardflow profile: {capture}")


def print_summary(title: str, est: sf.Estimator, result: sf.TrainResult, lines: Iterable[str] = ()) -> None:
    print(f"\n{title}")
    if result.start_step:
        print(
            f"  resumed          from the checkpoint at global step {result.start_step} in {est.model_dir}"
            " (pass a new --model-dir to start over)"
        )
    print(f"  global step      {result.global_step}  (worker steps: {_worker_steps(result)})")
    if result.first_loss is not None and result.final_loss is not None:
        print(f"  training loss    {result.first_loss:.3f} at the start -> {result.final_loss:.3f} at the end")
    else:
        print("  training loss    -  (no step left to train: the checkpoint is already at max_steps)")
    print(
        f"  throughput       {result.global_steps_per_s:.1f} global steps/s over {result.training_s:.1f} s of "
        f"training ({result.elapsed_s:.0f} s with start-up)"
    )
    for line in lines:
        print(f"  {line}")
    checkpoint = Path(str(result.checkpoint))
    print(f"  checkpoints      {checkpoint.parent}  (latest: {checkpoint.name})")
    tensorboard = est.model_dir / "tensorboard"
    print(f"  TensorBoard      {tensorboard}  ({command('tensorboard')} --logdir {shell_path(tensorboard)})")
    print(f"  logs             {est.model_dir / 'logs'}")
    if result.profile_dir is not None:
        capture = Path(result.profile_dir)
        print(f"  merged trace     {capture / 'merged.trace.json.gz'}  (or open it in ui.perfetto.dev)")
        print(
            f"  profile report   {write_profile_report(capture)}  "
            f"(or: {command('shardflow')} profile steps {shell_path(est.model_dir)})"
        )


def command(program: str) -> str:
    """How a fresh shell runs `program` of the environment running this script: by name where its PATH finds this
    one (the virtual environment is active), else by path (.venv/bin/shardflow), as `make demo` leaves it."""
    ours = Path(sys.executable).parent / program
    found = shutil.which(program)
    if not ours.exists() or (found is not None and Path(found).absolute() == ours.absolute()):
        return program
    return shell_path(ours)


def shell_path(path: str | os.PathLike[str]) -> str:
    """`path` as a shell word: relative to the working directory when inside it, else absolute."""
    absolute = Path(path).absolute()
    inside = absolute.is_relative_to(Path.cwd())
    return shlex.quote(str(absolute.relative_to(Path.cwd()) if inside else absolute))


def _worker_steps(result: sf.TrainResult) -> str:
    return ", ".join(f"{name} {steps}" for name, steps in sorted(result.worker_steps.items()))
