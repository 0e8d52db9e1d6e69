"""Recipes run as ``python -m recipes.<name>...`` from the repository root: put the root on the path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
