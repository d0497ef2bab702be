import sys
from pathlib import Path

# tests/dist_utils.py (shared multi-process helpers) importable as `dist_utils`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
