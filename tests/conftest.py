"""Shared test setup: the repository root (for `demos`) and `tests/` (for `launch_util`, `netns`) on the import path,
the tiers and their guard, and the session's cache of failure-free reference runs.

The tests mirror the rooms, one tier per folder, and the folder decides: `unit/` is pure (no process, no socket,
no torch.distributed group or store), `protocol/` runs in this one process (the in-process transport, loopback
sockets and one-process gloo groups, simulation), `e2e/` starts real processes with real signals and is marked
``e2e`` by this file. A guard fails a test that steps outside its tier, naming what it did and where the test
belongs. Keep this file small; fixtures that serve one module belong in that module.
"""

from __future__ import annotations

import ipaddress
import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch._C._distributed_c10d as c10d
import zmq

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


def tier(item: pytest.Item) -> str:
    """The tier of a test: the folder under `tests/` it lives in (unit, protocol or e2e)."""
    return Path(item.path).resolve().relative_to(TESTS).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="one of the full matrix's kill points: run with --all-kill-points")
    for item in items:
        if tier(item) == "e2e":
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("full_matrix") is not None and not config.getoption("--all-kill-points"):
            item.add_marker(skip)


class TierError(AssertionError):
    """A test did what its tier does not allow (a process started from unit/ or protocol/, a socket in unit/)."""


def _loopback(address: object) -> bool:
    """Whether `address` (a socket's, a ZeroMQ endpoint or a store's host) stays on this machine."""
    if isinstance(address, (str, bytes)) and "://" not in str(address) and not str(address)[:1].isalnum():
        return True  # a Unix socket's path (or an abstract one)
    host = address[0] if isinstance(address, tuple) else str(address)
    if isinstance(address, str) and "://" in address:  # a ZeroMQ endpoint: inproc://, ipc://, tcp://HOST:PORT
        scheme, _, rest = address.partition("://")
        if scheme != "tcp":
            return scheme in ("inproc", "ipc")
        host = rest.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refusals(where: str) -> list[tuple[Any, str, str, bool]]:
    """(owner, attribute, what it does, whether a loopback address is allowed) of every call `where` refuses:
    protocol/ may use sockets on the loopback only, unit/ none."""
    loopback = where == "protocol"
    refused = [(subprocess.Popen, "__init__", "starts a process", False), (os, "fork", "forks", False),
               (os, "forkpty", "forks", False), (os, "posix_spawn", "starts a process", False),
               (os, "posix_spawnp", "starts a process", False), (os, "system", "starts a process", False),
               (multiprocessing.process.BaseProcess, "start", "starts a process", False),
               (socket.socket, "bind", "binds a socket", loopback),
               (socket.socket, "connect", "connects a socket", loopback),
               (zmq.Socket, "bind", "binds a socket", loopback), (zmq.Socket, "connect", "connects a socket", loopback),
               (c10d.TCPStore, "__init__", "opens a TCPStore", loopback)]
    if where == "unit":
        refused.append((c10d.ProcessGroupGloo, "__init__", "builds a torch.distributed group", False))
    return refused


def _refused(original: Callable[..., Any], what: str, where: str, loopback: bool) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        address = args[1] if len(args) > 1 else kwargs.get("host_name", kwargs.get("addr"))
        if loopback and _loopback(address):
            return original(*args, **kwargs)
        raise TierError(f"a test in tests/{where}/ {what}{' off the loopback' if loopback else ''}: tests/unit is "
                        "pure and tests/protocol runs in one process on the loopback; a test that starts processes "
                        "belongs in tests/e2e, one that needs sockets or groups in tests/protocol")
    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Outside tests/e2e, set-up, call and tear-down of the test run with its tier's refusals in place."""
    where = tier(item)
    if where == "e2e":
        yield
        return
    refusals = _refusals(where)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _, _ in refusals]
    for (owner, name, what, loopback), (_, _, original) in zip(refusals, saved, strict=True):
        setattr(owner, name, _refused(original, what, where, loopback))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.fixture(scope="session")
def gpt_reference(references: References) -> LaunchResult:
    """The GPT demo without failures (4 ranks, 1 spare, REFERENCE_STEPS steps), run once for every e2e module
    whose failure runs of it must end with its final state digest."""
    return references.get(DEMO, ("--nproc", "4", "--spares", "1"))
