"""research/tests is outside the default test run (pyproject's testpaths) and not a package: put the repository
root on sys.path so its tests import ``tests.helpers`` however pytest is started (`python -m pytest research/tests`
from the root, `pytest research/tests`, or from elsewhere)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
