"""Shared test setup: the repository root (for `demos`) and `tests/` (for `launch_util`, `netns`) on the import path.

The tests mirror the rooms: `unit/` (pure logic, no I/O), `protocol/` (in-process transport,
real sockets inside one process, simulation) and `e2e/` (real processes, real signals; marked
``e2e``).  Keep this file small; fixtures that serve one module belong in that module (``gpt_reference`` serves
several: one failure-free run instead of one per module).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS.parent, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from launch_util import REFERENCE_STEPS, LaunchResult, launch  # noqa: E402  (found through the path set above)


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    """The GPT demo without failures (4 ranks, 1 spare, REFERENCE_STEPS steps), run once for every e2e module
    whose failure runs of it must end with its final state digest."""
    result = launch(tmp_path_factory.mktemp("gpt-reference"), "--nproc", "4", "--spares", "1", steps=REFERENCE_STEPS)
    assert result.returncode == 0, result.output[-3000:]
    assert result.digest, result.output[-3000:]
    assert not result.of("member_failed")
    return result


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all-kill-points", action="store_true",
                     help="run every kill point of the e2e matrices that the default suite samples (compiled blocks)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--all-kill-points"):
        return
    skip = pytest.mark.skip(reason="one of the full matrix's kill points: run with --all-kill-points")
    for item in items:
        if item.get_closest_marker("full_matrix") is not None:
            item.add_marker(skip)
