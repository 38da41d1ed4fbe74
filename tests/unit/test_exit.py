"""The exit guard: which processes skip the interpreter's teardown, with which status, and the excepthook."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from deadpool.worker.exit import ExitGuard


class Exited(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> ExitGuard:
    """A guard whose atexit registration and os._exit are recorded instead of done."""
    registered: list[Any] = []
    monkeypatch.setattr("atexit.register", registered.append)

    def fake_exit(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr("os._exit", fake_exit)
    monkeypatch.setattr("logging.shutdown", lambda: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    return ExitGuard()


def test_a_plain_process_exits_normally(guard: ExitGuard) -> None:
    stops: list[str] = []
    guard.arm(lambda: stops.append("stop"))
    guard.at_exit()  # returns: nothing retired, no error, runtime not finished
    assert stops == []


def test_a_retired_group_makes_the_process_skip_teardown_and_stop_the_runtime_thread(guard: ExitGuard) -> None:
    stops: list[str] = []
    guard.arm(lambda: stops.append("stop"))
    guard.retire(object())
    with pytest.raises(Exited) as exited:
        guard.at_exit()
    assert exited.value.status == 0
    assert stops == ["stop"]


def test_after_finish_there_is_no_thread_to_stop(guard: ExitGuard) -> None:
    stops: list[str] = []
    guard.arm(lambda: stops.append("stop"))
    guard.finish()
    with pytest.raises(Exited) as exited:
        guard.at_exit()
    assert exited.value.status == 0
    assert stops == []


def test_an_uncaught_exception_sets_status_1_and_reaches_the_previous_hook(guard: ExitGuard) -> None:
    seen: list[type[BaseException]] = []
    sys.excepthook = lambda kind, value, tb: seen.append(kind)
    guard.arm(lambda: None)
    guard.arm(lambda: None)  # a second runtime in the same process: the hook is installed once
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert seen == [ValueError]
    with pytest.raises(Exited) as exited:
        guard.at_exit()
    assert exited.value.status == 1
