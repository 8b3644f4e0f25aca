"""The profiler's diagnosis names the right bottleneck on three staged real runs."""

from __future__ import annotations

import pytest

from shardflow.profile.capture import finalize
from shardflow.profile.diagnose import diagnose
from shardflow.profile.events import load


@pytest.mark.parametrize(("kind", "bottleneck"), [("input", "input"), ("ps", "ps"), ("compute", "compute")])
def test_diagnosis_names_the_bottleneck_of_a_staged_run(run_job, kind, bottleneck):
    proc, result = run_job("staged.py", kind=kind)
    assert proc.returncode == 0, proc.stdout
    findings = diagnose(load(finalize(result["profile_dir"])))
    assert findings[0].bottleneck == bottleneck, [f.message for f in findings]
