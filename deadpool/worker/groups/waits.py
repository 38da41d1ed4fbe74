"""Waiting on collectives that can be abandoned: the seat's interruptible wait and the work adapters.

gloo cannot cancel a collective, so a wait here is on a condition that completion or an
interrupt (a Prepare) wakes (``Waiter``); the works DeadPool hands to torch wrap gloo's: a script's
collective that never raises (``UserWork``), several as one (``Works``), and those that progress
only inside ``wait()``, waited on by their group's thread (``WaitedWork``, ``WaitThread``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deadpool.errors import CollectiveAborted

POLL_FIRST_S = 0.0002  # a future-less work's completion is polled from this interval ...
POLL_MAX_S = 0.005  # ... doubling up to this one
FIRST_WAIT = timedelta(milliseconds=5)  # most collectives are done within it: waited on in C++ first


class WaitClock:
    """The seconds the compute thread spent waiting on collectives since it last asked (per step): the seat the
    others wait for waits least, so its step time less this is what its own compute took."""

    def __init__(self) -> None:
        self._waited = 0.0

    def add(self, seconds: float) -> None:
        self._waited += seconds

    def take(self) -> float:
        """The seconds waited since the previous call."""
        waited, self._waited = self._waited, 0.0
        return waited


class Waiter:
    """Wakes the compute thread when a collective completes or an interrupt arrives.

    A collective is first waited on for a few milliseconds inside the work itself (no Python
    wake-up, so a step's many short collectives cost what torch's own waits cost).  Past that,
    both sources notify the same condition (the Handoff's), so one wait covers both without
    polling.
    """

    def __init__(self, condition: threading.Condition, interrupted: Callable[[], bool],
                 clock: WaitClock | None = None) -> None:
        self._condition = condition
        self._interrupted = interrupted
        self._clock = clock

    def wait(self, work: dist.Work, what: str, bound: float) -> None:
        """Wait for `work`, giving up on interrupt or after `bound` seconds (the time it took goes to the clock).

        Raises:
            CollectiveAborted: the collective failed (peer died), was interrupted, or timed out.
        """
        started = time.perf_counter()
        try:
            self._wait(work, what, bound)
        finally:
            if self._clock is not None:
                self._clock.add(time.perf_counter() - started)

    def _wait(self, work: dist.Work, what: str, bound: float) -> None:
        try:
            work.wait(FIRST_WAIT)
            return
        except RuntimeError:
            if work.is_completed():  # it failed (or finished just after the wait ran out): the wait below says
                self._finish(work, what)
                return
        finished = threading.Event()
        try:
            future = work.get_future()
        except RuntimeError:  # some gloo works (the coalesced ones) have no future: poll their completion
            future = None
        if future is not None:

            def on_done(_: torch.futures.Future[object]) -> None:
                finished.set()
                with self._condition:
                    self._condition.notify_all()

            future.add_done_callback(on_done)
        deadline = time.monotonic() + bound
        poll = POLL_FIRST_S
        with self._condition:
            while not finished.is_set():
                if future is None and work.is_completed():
                    break
                if self._interrupted():
                    raise CollectiveAborted(what, "interrupted by the membership service", interrupted=True)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveAborted(what, f"no completion within {bound:.1f}s")
                if future is None:
                    self._condition.wait(min(remaining, poll))
                    poll = min(poll * 2, POLL_MAX_S)
                else:
                    self._condition.wait(min(remaining, 0.5))
        self._finish(work, what)

    @staticmethod
    def _finish(work: dist.Work, what: str) -> None:
        """A completed work's outcome.

        Raises:
            CollectiveAborted: it failed.
        """
        try:
            work.wait()
        except RuntimeError as err:
            raise CollectiveAborted(what, str(err).splitlines()[0] if str(err) else repr(err)) from err


class UserWork(dist.Work):
    """A collective of the script's: waiting completes it, and never raises.

    `finish` runs once, on the first wait: it waits for the real collective and
    copies its staged result into the script's tensors, or, when the step was
    poisoned, leaves them well-formed with local values.
    """

    def __init__(self, finish: Callable[[], None] | None, real: dist.Work | None, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._finish = finish
        self._real = real
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None or self._real is None or self._real.is_completed()

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        self.wait()
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._result)
        return future


class Works(dist.Work):
    """Several gloo works as one: done when all are; its future completes with the last of theirs."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for all; with `timeout`, raise RuntimeError if they are not done by then (like a gloo work)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> torch.futures.Future[Any]:
        if len(self._works) == 1:
            return self._works[0].get_future()
        return torch.futures.collect_all([work.get_future() for work in self._works])


class WaitThread:
    """One gloo group's thread for works that progress only inside ``wait()`` (gloo's reduce-scatter).

    It waits on them in the order they were issued, which is the order gloo runs a group's
    collectives in, so that the seat can wait for a ``WaitedWork`` interruptibly or give up on it.
    `close` ends the thread once it is idle; one blocked in an abandoned collective ends when gloo
    gives up on it (the group's timeout).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[WaitedWork | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"deadpool-progress-{name}", daemon=True).start()

    def submit(self, work: WaitedWork) -> None:
        self._queue.put(work)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work.progress()


class WaitedWork(dist.Work):
    """Works that progress only inside ``wait()``, waited on by their group's ``WaitThread``.

    Its future completes when those waits return (or with their error).
    """

    def __init__(self, works: list[dist.Work], progress: WaitThread) -> None:
        super().__init__()
        self._works = works
        self._future: torch.futures.Future[None] = torch.futures.Future()
        self._done = threading.Event()
        progress.submit(self)

    def progress(self) -> None:
        """Wait for the works (on the progress thread)."""
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as err:
            self._future.set_exception(err)  # type: ignore[arg-type]  # the stub types the argument as the result
        else:
            self._future.set_result(None)
        finally:
            self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the works; with `timeout`, raise RuntimeError if they are not done by then (like gloo)."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"not completed within {timeout}")
        self._future.wait()  # raises the works' error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

