"""Shared test setup: import paths and fixtures used by more than one test module.

Keep this file small; fixtures that serve one module belong in that module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deadpool  # noqa: E402  (needs ROOT on sys.path)


