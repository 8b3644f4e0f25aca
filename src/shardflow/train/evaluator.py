"""The side-car evaluator's role: evaluate each checkpoint the chief writes, until the job is over."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from shardflow.cluster import control_keys
from shardflow.train import job_keys
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.eval_history import history_path
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import EvaluationResult
from shardflow.train.role_context import RoleContext
from shardflow.train.summaries import Summaries

log = logging.getLogger(__name__)


def run_evaluator(job: JobConfig[Any], role: RoleContext) -> None:
    """The side-car evaluator: evaluate each new checkpoint as the chief writes it, until the job ends."""
    eval_spec = job.eval_spec
    evaluated: str | None = None
    summaries = None
    history = history_path(job.model_dir)
    while True:
        over = role.control.is_set(control_keys.SHUTDOWN)
        path = store.latest(job.model_dir)
        if eval_spec is not None and path is not None and path.name != evaluated:
            evaluated = path.name
            step = store.global_step(path)
            model = job.build_model()
            state = store.load_state(path)[0]
            model.load_state_dict(state.params)
            with saved_tables(model, state, job.model_dir):
                metrics = job.evaluate(model, eval_spec)
            history.parent.mkdir(parents=True, exist_ok=True)
            with open(history, "a") as f:
                f.write(json.dumps({"global_step": step, "checkpoint": path.name, "metrics": metrics}) + "\n")
            if summaries is None:
                summaries = Summaries(job.model_dir)
            summaries.evaluation(step, metrics)
            log.info("evaluator: %s at global step %d: %s", path.name, step, metrics)
            continue
        if over:
            # The chief writes its final checkpoint before it says the job is over, so this one is the last.
            final = (
                EvaluationResult(metrics={})
                if evaluated is None
                else EvaluationResult(checkpoint=evaluated, metrics=metrics)
            )
            role.control.put(job_keys.EVAL_FINAL, final)
            break
        time.sleep(0.5)
    if summaries is not None:
        summaries.close()
