import sys
from pathlib import Path

# tests/reference.py is imported by several test files and by scripts/benchmark.py.
sys.path.insert(0, str(Path(__file__).parent))
