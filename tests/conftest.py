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

# --- TEMPORARY import shim, until pyproject.toml installs the package --------
# The top-level ``transports/`` folder ships as ``deadpool.transports``
# (setuptools ``package-dir``).  Without an install, load that folder under its
# packaged name, so ``open_transport`` and the tests import each transport
# module exactly once, under one name (importing it also as top-level
# ``transports.*`` would create second copies with their own registries).
# Delete this block once ``pip install -e .`` provides ``deadpool.transports``.
try:
    import deadpool.transports  # noqa: F401
except ModuleNotFoundError:
    _spec = importlib.util.spec_from_file_location(
        "deadpool.transports",
        ROOT / "transports" / "__init__.py",
        submodule_search_locations=[str(ROOT / "transports")],
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["deadpool.transports"] = _module
    _spec.loader.exec_module(_module)
    deadpool.transports = _module  # type: ignore[attr-defined]
# ------------------------------------------------------------------------------
