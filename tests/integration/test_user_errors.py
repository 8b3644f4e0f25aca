"""Errors of the user's code or data, as a new user meets them: said once, naming the fix, and not restarted (the
same error would come back); int32 ids just work."""

from __future__ import annotations

import os
import subprocess


def test_a_per_example_loss_fails_the_job_once_saying_to_reduce_it_and_is_not_restarted(run_job):
    proc, _ = run_job("regression.py", reduction="none", num_batches=20, epochs=1)
    assert proc.returncode != 0
    out = proc.stdout
    assert "loss_fn returned a tensor of shape (8, 1); it must return a scalar" in out, out
    assert "loss.mean()" in out and "reduction='mean'" in out, out
    assert "restarting it" not in out, out  # the same error would come back
    assert out.count("it must return a scalar") <= 4, out  # each worker once, and the chief's summary


def test_int32_ids_into_a_sparse_embedding_train_as_int64_do(run_job):
    proc, result = run_job("embedding.py", ids_dtype="int32", mode="async", num_batches=16)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 16


def test_an_unwritable_model_dir_is_named_before_any_role_starts(run_job, tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(read_only)], check=False)
    try:
        if os.access(read_only, os.W_OK) and os.geteuid() != 0:
            read_only.chmod(0o500)
        proc, _ = run_job("regression.py", model_dir=str(read_only / "model"), num_batches=20, epochs=1)
    finally:
        subprocess.run(["umount", str(read_only)], check=False)
    out = proc.stdout
    assert proc.returncode != 0
    assert f"model_dir {read_only / 'model'} cannot be written" in out, out
    assert "serving at" not in out and out.count("Traceback") <= 1, out  # no role started
