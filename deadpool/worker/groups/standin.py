"""The NCCL stand-in: gloo with NCCL's failure semantics, so that the abort path runs on a machine without a GPU.

A test aid (``DEADPOOL_NCCL_STANDIN=1``), not a user feature.  Where it matters for fault tolerance,
NCCL differs from gloo in one way: a collective whose peer died does not raise.  Its kernel spins
until the communicator is aborted (or torch's watchdog gives up on it, after the collective
timeout), and while it spins it holds the device, so the process's later collectives, on any
communicator, wait behind it.  The stand-in reproduces exactly that: it issues every collective on
gloo; a work whose gloo collective failed does not complete but counts as stuck, and a stuck work
holds this process's ``DEVICE`` until its communicator is aborted (the work then fails) or the
collective timeout passes.  A collective issued while the device is held waits for it.  Without the
abort a survivor's first collective after a swap therefore waits out the collective timeout, as it
would on NCCL (``tests/e2e/test_nccl_standin.py`` shows both).
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


class Device:
    """The device of this process, as stuck NCCL kernels hold it: a collective issued meanwhile waits."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._holders: set[int] = set()  # ids of the stand-in groups with a stuck work

    def hold(self, group: StandInGroup) -> None:
        with self._condition:
            self._holders.add(id(group))

    def release(self, group: StandInGroup) -> None:
        with self._condition:
            self._holders.discard(id(group))
            self._condition.notify_all()

    def wait_free(self, bound: float) -> None:
        """Wait while a stuck work holds the device (at most `bound` seconds: its own timeout ends it by then)."""
        deadline = time.monotonic() + bound
        with self._condition:
            while self._holders and (left := deadline - time.monotonic()) > 0:
                self._condition.wait(left)


DEVICE = Device()


class StandInWork(dist.Work):
    """A stand-in collective: done when its gloo collective is, unless that failed (then stuck, see module)."""

    def __init__(self, inner: dist.Work) -> None:
        super().__init__()
        self.inner = inner
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._done = threading.Event()

    def succeed(self) -> None:
        self._future.set_result(None)
        self._done.set()

    def fail(self, why: str) -> None:
        self._future.set_exception(RuntimeError(why))  # type: ignore[arg-type]  # the stub types it as the result
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"not completed within {timeout}")
        self._future.wait()  # raises the failure
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._future.done() and not self._failed()

    def _failed(self) -> bool:
        try:
            self._future.value()
        except RuntimeError:
            return True
        return False

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class StandInGroup:
    """One stand-in communicator: a gloo group whose collectives are settled, in issue order, by a thread of its
    own (gloo runs a group's collectives in that order).  `abort()` fails its stuck and pending works and frees
    the device; `abortable` False (the test of the hang) makes it a no-op."""

    def __init__(self, gloo: Any, timeout: float, name: str, abortable: bool = True) -> None:
        self._gloo = gloo
        self._timeout = timeout
        self._aborted = threading.Event()
        self._abortable = abortable
        self._works: queue.SimpleQueue[StandInWork | None] = queue.SimpleQueue()
        threading.Thread(target=self._settle, name=f"deadpool-standin-{name}", daemon=True).start()

    def abort(self) -> None:
        if self._abortable:
            self._aborted.set()

    def close(self) -> None:
        self._works.put(None)

    def _settle(self) -> None:
        while (work := self._works.get()) is not None:
            if self._aborted.is_set():
                work.fail("NCCL stand-in: communicator aborted")
                continue
            try:
                work.inner.wait()
            except RuntimeError as err:  # a peer died: NCCL's kernel would spin here, holding the device
                DEVICE.hold(self)
                try:
                    aborted = self._aborted.wait(self._timeout)
                finally:
                    DEVICE.release(self)
                work.fail("NCCL stand-in: communicator aborted" if aborted else
                          f"NCCL stand-in: collective timed out after {self._timeout:.0f}s ({err})")
            else:
                work.succeed()

    def _issue(self, issue: Callable[[Any], dist.Work]) -> dist.Work:
        DEVICE.wait_free(self._timeout)
        work = StandInWork(issue(self._gloo)) if not self._aborted.is_set() else StandInWork(_NOTHING)
        self._works.put(work)
        return work

    # What DeadPool's groups issue (``groups.py``, ``collective.py``), on gloo.

    def rank(self) -> int:
        return int(self._gloo.rank())

    def size(self) -> int:
        return int(self._gloo.size())

    def allreduce(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.allreduce(*args))

    def broadcast(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.broadcast(*args))

    def allgather(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.allgather(*args))

    def _allgather_base(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g._allgather_base(*args))

    def _reduce_scatter_base(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g._reduce_scatter_base(*args))

    def alltoall(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.alltoall(*args))

    def alltoall_base(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.alltoall_base(*args))

    def gather(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.gather(*args))

    def scatter(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.scatter(*args))

    def reduce(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.reduce(*args))

    def send(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.send(*args))

    def recv(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.recv(*args))

    def barrier(self, *args: Any) -> dist.Work:
        return self._issue(lambda g: g.barrier(*args))


class _Done(dist.Work):
    """The gloo side of a work issued on an aborted stand-in: nothing (it fails at once)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise RuntimeError("NCCL stand-in: communicator aborted")


_NOTHING = _Done()
