"""Shared test setup: the repository root (for `demos`) and `tests/` (for `launch_util`, `netns`) on the import path.

The tests mirror the rooms: `unit/` (pure logic, no I/O), `protocol/` (in-process transport,
real sockets inside one process, simulation) and `e2e/` (real processes, real signals; marked
``e2e``).  Keep this file small; fixtures that serve one module belong in that module.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for path in (TESTS.parent, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
