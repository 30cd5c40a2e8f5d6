"""The example's tests run from a checkout too: the package folder goes on sys.path when it is not installed."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
