"""Shared test setup: the repository root (for `demos`) and `tests/` (for `launch_util`, `netns`) on the import path.

The tests mirror the rooms: `unit/` (pure logic, no I/O), `protocol/` (in-process transport,
real sockets inside one process, simulation) and `e2e/` (real processes, real signals; marked
``e2e``).  Keep this file small; fixtures that serve one module belong in that module (``gpt_reference`` serves
several: one failure-free run instead of one per module).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS.parent, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from launch_util import DEMO, REFERENCE_STEPS, LaunchResult, launch  # noqa: E402  (found through the path set above)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all-kill-points", action="store_true",
                     help="run every kill point of the e2e matrices that the default suite samples (compiled blocks)")
    parser.addoption("--nccl-standin", action="store_true",
                     help="every job the e2e tests launch runs its groups on the NCCL stand-in "
                          "(DEADPOOL_NCCL_STANDIN=1: gloo with NCCL's failure semantics: every repair aborts)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--nccl-standin"):
        os.environ["DEADPOOL_NCCL_STANDIN"] = "1"  # inherited by every process a test starts


class References:
    """Failure-free runs shared by every test of the session that needs one, keyed by what was launched."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._runs: dict[tuple[str, tuple[str, ...], tuple[str, ...], int], LaunchResult] = {}

    def get(self, script: Path, launch_args: tuple[str, ...], script_args: tuple[str, ...] = (),
            steps: int = REFERENCE_STEPS) -> LaunchResult:
        """The failure-free run of `script` (launched once per session; never on the NCCL stand-in, whose runs
        must end with the same digest), checked to have finished with a digest and no failure."""
        key = (str(script), launch_args, script_args, steps)
        if key not in self._runs:
            where = self._root / f"run{len(self._runs)}"
            where.mkdir()
            result = launch(where, *launch_args, script=script, steps=steps, script_args=script_args,
                            env={"DEADPOOL_NCCL_STANDIN": "0"})
            assert result.returncode == 0 and result.digest, result.output[-3000:]
            assert not result.of("member_failed"), result.output[-3000:]
            self._runs[key] = result
        return self._runs[key]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--all-kill-points"):
        return
    skip = pytest.mark.skip(reason="one of the full matrix's kill points: run with --all-kill-points")
    for item in items:
        if item.get_closest_marker("full_matrix") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpt_reference(references: References) -> LaunchResult:
    """The GPT demo without failures (4 ranks, 1 spare, REFERENCE_STEPS steps), run once for every e2e module
    whose failure runs of it must end with its final state digest."""
    return references.get(DEMO, ("--nproc", "4", "--spares", "1"))
