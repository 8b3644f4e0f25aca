"""sf.AllReduceStrategy on a real local cluster (a chief and workers as processes on 127.0.0.1): synchronous data
parallelism equal to one process on the workers' batches together, with an exact global step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def _trained(model_dir: Path) -> dict[str, torch.Tensor]:
    root = model_dir / "checkpoints"
    return load_file(str(root / (root / "latest").read_text() / "model.safetensors"))


def _data(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(num_rows, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(num_rows, 1, generator=generator)
    return x, y


def _one_process(batches: list[slice], optimizer: str, lr: float, num_rows: int) -> torch.nn.Module:
    """The job's model trained in one process, one update per slice of rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = _data(num_rows)
    kind = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    opt = kind(model.parameters(), lr=lr)
    for rows in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return model


def _assert_equals_one_process(model_dir: Path, rows_per_step: int, steps: int, optimizer: str, lr: float) -> None:
    """The final checkpoint equals one process that took `rows_per_step` rows a step, in order, to 1e-5."""
    batches = [slice(s * rows_per_step, (s + 1) * rows_per_step) for s in range(steps)]
    expected = _one_process(batches, optimizer, lr, steps * rows_per_step)
    trained = _trained(model_dir)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0)


def test_two_workers_of_batch_b_equal_one_process_on_batches_of_2b(run_job, tmp_path):
    steps, batch = 10, 8
    proc, result = run_job("allreduce.py", num_workers=2, epochs=1, num_batches=2 * steps, batch=batch, lr=0.1)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    assert result["worker_steps"] == {"worker:0": steps, "worker:1": steps}

    _assert_equals_one_process(tmp_path / "model", 2 * batch, steps, "sgd", 0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: workers that compute on a GPU")
def test_two_workers_sharing_a_gpu_equal_one_process_with_adam_and_a_checkpoint_on_the_way(run_job, tmp_path):
    # Both workers on the machine's first GPU: gloo sums their gradients through pinned host buffers. Adam's slots
    # live on the GPU and go to the checkpoint of step 5 from there.
    steps, batch = 10, 8
    config = {"optimizer": "adam", "device": "cuda:0", "save_checkpoints_steps": 5}
    proc, result = run_job(
        "allreduce.py", num_workers=2, epochs=1, num_batches=2 * steps, batch=batch, lr=0.05, **config
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    _assert_equals_one_process(tmp_path / "model", 2 * batch, steps, "adam", 0.05)


def test_bf16_mixed_precision_computes_the_forward_in_bfloat16_and_trains(run_job, tmp_path):
    steps_log = tmp_path / "steps.log"
    proc, result = run_job(
        "allreduce.py", num_workers=2, max_steps=20, num_batches=100, mixed_precision="bf16", step_log=str(steps_log)
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 20
    dtypes = {line.split()[1] for line in steps_log.read_text().splitlines()}
    assert dtypes == {"torch.bfloat16"}, dtypes
    assert all(value.dtype == torch.float32 for value in _trained(tmp_path / "model").values())
    assert result["final_loss"] < result["first_loss"], result


def test_two_workers_accumulating_2_batches_of_b_equal_one_process_on_batches_of_4b(run_job, tmp_path):
    steps, batch = 6, 8
    proc, result = run_job(
        "allreduce.py", num_workers=2, epochs=1, num_batches=4 * steps, batch=batch, lr=0.1, accumulation=2
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    # Worker w reads batches w, w + 2, ...: step s holds batches 4s to 4s + 3, on the two workers together.
    _assert_equals_one_process(tmp_path / "model", 4 * batch, steps, "sgd", 0.1)


def test_max_steps_is_exact(run_job):
    proc, result = run_job("allreduce.py", num_workers=2, max_steps=7, num_batches=100)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 7


def test_uneven_shards_the_mean_is_over_the_workers_that_had_a_batch(run_job, tmp_path):
    # 5 batches on 2 workers: steps 0 and 1 average two batches each, step 2 is worker:0's batch 4 alone.
    batch = 8
    proc, result = run_job("allreduce.py", num_workers=2, epochs=1, num_batches=5, batch=batch, lr=0.1)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 3
    rows = [slice(0, 2 * batch), slice(2 * batch, 4 * batch), slice(4 * batch, 5 * batch)]
    expected = _one_process(rows, "sgd", 0.1, 5 * batch)
    trained = _trained(tmp_path / "model")
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0)


def test_a_worker_that_dies_fails_the_job_naming_it(start_job, tmp_path):
    steps = tmp_path / "steps.log"
    job = start_job("allreduce.py", num_workers=2, epochs=1, num_batches=400, step_delay_s=0.05, step_log=str(steps))
    deadline = time.monotonic() + 60
    while not steps.exists() or len(steps.read_text().splitlines()) < 6:  # into training
        assert time.monotonic() < deadline and job.proc.poll() is None, job.finish(5)[1]
        time.sleep(0.1)
    job.roles()["worker:1"].kill()
    code, output = job.finish(90)
    assert code != 0
    assert "RoleFailedError: worker:1" in output and "SIGKILL" in output


def test_the_chief_evaluates_at_every_n_steps_and_the_final_state(run_job, tmp_path):
    proc, result = run_job("allreduce.py", num_workers=2, max_steps=7, eval_every=3, num_batches=100)
    assert proc.returncode == 0, proc.stdout
    assert result["eval_steps"] == [3, 6, 7]
    assert result["metrics"]["loss"] > 0
    assert (tmp_path / "model" / "tensorboard" / "eval").is_dir()


def test_the_chief_evaluates_every_n_secs_while_training_and_the_final_state(run_job):
    # 40 steps of at least 0.05 s each: 2 s or more of training, evaluated at most every 0.4 s.
    proc, result = run_job(
        "allreduce.py", num_workers=2, max_steps=40, eval_every_secs=0.4, num_batches=100, step_delay_s=0.05
    )
    assert proc.returncode == 0, proc.stdout
    steps = result["eval_steps"]
    assert len(steps) >= 3 and steps[-1] == 40, steps
    assert steps == sorted(set(steps)), steps  # each state evaluated once, in order


def test_a_side_car_evaluator_follows_checkpoints_and_reports_the_final_metrics(run_job, tmp_path):
    proc, result = run_job(
        "allreduce.py", num_workers=2, max_steps=20, save_checkpoints_steps=5, eval_every=5, evaluator=True
    )
    assert proc.returncode == 0, proc.stdout
    history = [json.loads(line) for line in (tmp_path / "model" / "eval" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["global_step"] == 20
    assert result["metrics"] == history[-1]["metrics"]
    assert result["eval_steps"] == []  # the chief left every evaluation to the evaluator
    assert (tmp_path / "model" / "logs" / "evaluator.log").exists()


@pytest.mark.parametrize("evaluator", [False, True])
def test_early_stopping_ends_training_before_max_steps(run_job, evaluator):
    # A loss that must fall by 1e9 to count as better: training stops after the second evaluation, the chief's or
    # (evaluator) the side-car's, of the checkpoints of every 2 steps, read back from eval/history.jsonl.
    proc, result = run_job(
        "allreduce.py",
        num_workers=2,
        max_steps=200,
        eval_every=2,
        early_stopping_min_delta=1e9,
        num_batches=400,
        step_delay_s=0.05,
        evaluator=evaluator,
        save_checkpoints_steps=2 if evaluator else None,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["stopped_early"] and result["global_step"] < 200
    if not evaluator:
        assert result["eval_steps"][:2] == [2, 4]


def test_estimator_state_dict_is_the_final_checkpoints_parameters(run_job, tmp_path):
    proc, result = run_job("allreduce.py", num_workers=2, max_steps=3, num_batches=100)
    assert proc.returncode == 0, proc.stdout
    trained = _trained(tmp_path / "model")
    assert set(result["state_dict"]) == set(trained)
    for name, value in trained.items():
        assert torch.tensor(result["state_dict"][name]).equal(value)


def test_sigterm_checkpoints_at_the_next_step_and_a_rerun_trains_on_as_one_process(start_job, run_job, tmp_path):
    config = {"num_workers": 2, "max_steps": 40, "num_batches": 100, "batch": 8, "lr": 0.1}
    steps = tmp_path / "steps.log"
    job = start_job("allreduce.py", **config, step_delay_s=0.1, step_log=str(steps))
    deadline = time.monotonic() + 60
    while not steps.exists() or len(steps.read_text().splitlines()) < 6:  # a few steps in
        assert time.monotonic() < deadline and job.proc.poll() is None, job.finish(5)[1]
        time.sleep(0.1)
    job.proc.send_signal(signal.SIGTERM)
    code, output = job.finish(60)
    assert code == 143, output
    first = json.loads((tmp_path / "result.json").read_text())
    assert first["preempted"] and 0 < first["global_step"] < 40, output

    proc, result = run_job("allreduce.py", **config)
    assert proc.returncode == 0, proc.stdout
    assert result["start_step"] == first["global_step"] and result["global_step"] == 40
    expected = _one_process([slice(16 * s, 16 * s + 16) for s in range(40)], "sgd", 0.1, 100 * 8)
    trained = _trained(tmp_path / "model")
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0)


def test_a_hooks_stop_ends_one_workers_input_and_the_others_train_on(run_job):
    proc, result = run_job("allreduce.py", num_workers=2, epochs=1, num_batches=20, stop_worker_1_after=3)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 10
    assert result["worker_steps"] == {"worker:0": 10, "worker:1": 3}
