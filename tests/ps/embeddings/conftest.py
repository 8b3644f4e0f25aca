import sys
from pathlib import Path

# synthetic_tables.py is a helper module of these tests, imported by name.
sys.path.insert(0, str(Path(__file__).parent))
