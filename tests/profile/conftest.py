import sys
from pathlib import Path

import pytest

from shardflow.profile.capture import write_capture
from shardflow.profile.trace import read_trace

# synthetic.py is a helper module of these tests, imported by name.
sys.path.insert(0, str(Path(__file__).parent))

FIXTURE = Path(__file__).parent / "fixtures" / "three_roles"


@pytest.fixture
def fixture_model_dir(tmp_path: Path) -> Path:
    """MODEL_DIR holding the hand-built 3-role capture "fixture" (see fixtures/three_roles/README.md), laid out as
    the chief leaves it: the merged trace and its events table."""
    model_dir = tmp_path / "model"
    write_capture(
        [read_trace(path) for path in sorted(FIXTURE.glob("*.trace.json"))], model_dir / "profile" / "fixture"
    )
    return model_dir
