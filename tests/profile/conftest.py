import gzip
import shutil
import sys
from pathlib import Path

import pytest

# synthetic.py is a helper module of these tests, imported by name.
sys.path.insert(0, str(Path(__file__).parent))

FIXTURE = Path(__file__).parent / "fixtures" / "three_roles"


def write_capture(model_dir: Path, name: str, role_files: list[Path]) -> Path:
    """A capture directory laid out as the runtime leaves it: gzipped role traces."""
    directory = model_dir / "profile" / name
    directory.mkdir(parents=True)
    for path in role_files:
        with path.open("rb") as source, gzip.open(directory / (path.name + ".gz"), "wb") as target:
            shutil.copyfileobj(source, target)
    return directory


@pytest.fixture
def fixture_model_dir(tmp_path: Path) -> Path:
    """MODEL_DIR holding the hand-built 3-role capture "fixture" (see fixtures/three_roles/README.md)."""
    model_dir = tmp_path / "model"
    write_capture(model_dir, "fixture", sorted(FIXTURE.glob("*.trace.json")))
    return model_dir
