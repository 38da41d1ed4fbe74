"""Shared test setup: the repository root on the import path (for `demos` and `launch_util`).

Keep this file small; fixtures that serve one module belong in that module.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
