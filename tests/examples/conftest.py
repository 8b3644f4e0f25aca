import sys
from pathlib import Path

# fresh_shell.py is a helper module of these tests, imported by name.
sys.path.insert(0, str(Path(__file__).parent))
