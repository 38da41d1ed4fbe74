"""The communicators behind DeadPool's groups: built for one view per backend, aborted together when a seat is lost.

Every group DeadPool hands out (``rt.ddp``'s and torch's default group, each mesh dimension's, the
script's own) issues its collectives on a communicator built for one view under that view's store
prefix.  Which backend carries a tensor depends on its device: gloo for CPU tensors; NCCL for CUDA
tensors where the job's backend allows (``nccl.py``, torch's ``cpu:gloo,cuda:nccl`` on one torch
``ProcessGroup``); or, for tests on CPU, the NCCL stand-in (``standin.py``), gloo with NCCL's
failure semantics.  A collective whose peer died raises on gloo, but on NCCL it neither returns nor
raises until its communicator is aborted, and a communicator stuck so holds the device.  So the
escape from a failed collective is one path for every backend: as soon as the worker learns of the
loss (the Prepare, on the runtime thread), every live communicator that holds a lost seat is aborted,
together, on this module's aborter thread; the lost step's remaining collectives complete locally;
the groups that held the seat are rebuilt under the next view's prefix.  A communicator set aside
for any other reason (a rebuild) is aborted too; an aborted one is never used again.  gloo cannot
abort: its communicators are only set aside and left to time out (docs/architecture.md).
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deadpool.config import Backend, WorkerEnv
from deadpool.errors import MisuseError
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.worker import nccl

log = logging.getLogger("deadpool")

ABORT_BOUND_S = 10.0  # the aborts of one batch must return within this (NCCL's non-blocking abort does)


class Kind(enum.StrEnum):
    """The communicator a worker builds for a group."""

    GLOO = "gloo"  # gloo for every tensor (no GPU, or --backend gloo)
    NCCL = "nccl"  # gloo for CPU tensors, NCCL for CUDA tensors
    STANDIN = "nccl-standin"  # gloo with NCCL's failure semantics (DEADPOOL_NCCL_STANDIN=1, a test aid)


def choose(backend: Backend, cuda: bool, nccl: bool, standin: bool) -> tuple[Kind, str]:
    """The communicator kind for a worker, and why.

    `cuda` and `nccl`: this worker's torch has a CUDA device and NCCL; `standin`: the test aid is on.

    Raises:
        MisuseError: ``--backend nccl`` where there is no CUDA device or no NCCL.
    """
    if standin:
        return Kind.STANDIN, "DEADPOOL_NCCL_STANDIN=1: gloo with NCCL's failure semantics (a test aid)"
    if backend is Backend.NCCL and not (cuda and nccl):
        missing = "no CUDA device" if not cuda else "no NCCL in this torch"
        raise MisuseError(f"--backend nccl: {missing} on this machine (use --backend gloo or auto)")
    if backend is Backend.GLOO:
        return Kind.GLOO, "--backend gloo"
    if cuda and nccl:
        return Kind.NCCL, f"--backend {backend}: NCCL for CUDA tensors, gloo for CPU tensors"
    return Kind.GLOO, f"--backend {backend}: no {'NCCL' if cuda else 'CUDA device'} here, gloo for every tensor"


def communicator_kind(env: WorkerEnv, collective_timeout: float) -> tuple[Kind, torch.device | None]:
    """This worker's communicator kind (``choose``) and, for NCCL, its CUDA device, with NCCL's settings put in
    its environment before torch reads them (``nccl.env_settings``; a user's own value is kept, and named in a
    warning where it lets torch's watchdog end the process).

    Raises:
        MisuseError: ``--backend nccl`` where this worker has no CUDA device or no NCCL.
    """
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    kind, why = choose(env.backend, cuda, cuda and dist.is_nccl_available(), env.nccl_standin)
    log.info("communicators: %s", why)
    if kind is not Kind.NCCL:
        return kind, None
    settings, warnings = nccl.env_settings(os.environ, collective_timeout)
    for setting in settings:
        os.environ[setting.name] = setting.value
    for warning in warnings:
        log.warning("%s", warning)
    return kind, nccl.device_of(env.local_rank)


@dataclass
class Communicator:
    """One built communicator: the group it serves and the seats it holds."""

    name: str  # the store prefix it was built under
    seats: frozenset[int]  # the job's seats it connects
    backend: Any  # what collectives are issued on (a torch ProcessGroup, or the stand-in)
    abort: Callable[[], None] | None  # None: the backend cannot abort (gloo)


class Communicators:
    """This worker's live communicators; thread-safe.

    The compute thread adds the ones it builds and sets aside the ones it replaces; the runtime
    thread asks for those that hold lost seats to be aborted (``abort_holding``).  Aborts run on an
    aborter thread of this object's, a batch at a time, each communicator of a batch on a thread of
    its own (NCCL's aborts of several communicators must not wait on each other), so that neither the
    runtime thread's loop nor a compute thread stuck behind a hung collective waits for them.
    """

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._lock = threading.Lock()
        self._live: dict[int, Communicator] = {}  # id(backend) -> communicator
        self._aborted: set[int] = set()  # ids of the aborted ones (kept alive for good: exit.GUARD holds them)
        self._aborts: queue.SimpleQueue[tuple[list[Communicator], str] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0  # batches asked for and not yet returned
        self._thread: threading.Thread | None = None

    def add(self, name: str, seats: Iterable[int], backend: Any, abort: Callable[[], None] | None) -> None:
        with self._lock:
            self._live[id(backend)] = Communicator(name, frozenset(seats), backend, abort)

    def usable(self, backend: Any) -> bool:
        """`backend` was not aborted (an aborted communicator is never used again)."""
        with self._lock:
            return id(backend) not in self._aborted

    def retire(self, backend: Any) -> None:
        """Set `backend` aside: no longer live; aborted where it can be."""
        with self._lock:
            communicator = self._live.pop(id(backend), None)
        if communicator is not None and communicator.abort is not None:
            self._submit([communicator], "set aside")

    def abort_holding(self, seats: Iterable[int], why: str) -> None:
        """Abort, together, every live communicator holding one of `seats` (none given: every live one).
        Returns at once; the aborts run on the aborter thread."""
        lost = frozenset(seats)
        with self._lock:
            batch = [c for c in self._live.values() if c.abort is not None and (not lost or c.seats & lost)]
        if batch:
            self._submit(batch, why)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every abort asked for so far has returned; False if that took longer than `timeout`."""
        return self._idle.wait(timeout)

    def _submit(self, batch: list[Communicator], why: str) -> None:
        """Queue the aborts of those of `batch` not aborted yet (asked for once: a rebuild may set aside one that a
        Prepare had aborted already, on another thread)."""
        with self._lock:
            batch = [c for c in batch if id(c.backend) not in self._aborted]
            if not batch:
                return
            self._aborted.update(id(c.backend) for c in batch)  # from now on nothing is issued on them
            self._pending += 1
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deadpool-aborter", daemon=True)
                self._thread.start()
        self._aborts.put((batch, why))

    def _run(self) -> None:
        while (item := self._aborts.get()) is not None:
            batch, why = item
            started = time.perf_counter()
            by_name = {c.name: c for c in batch}
            pool = concurrent.futures.ThreadPoolExecutor(len(batch), thread_name_prefix="deadpool-abort")
            ordered = [by_name[name] for name in nccl.abort_order(list(by_name))]  # started in one order everywhere
            futures = {pool.submit(c.abort): c for c in ordered if c.abort is not None}
            done, late = concurrent.futures.wait(futures, ABORT_BOUND_S)
            pool.shutdown(wait=False)  # an abort that did not return within the bound is left behind, not joined
            failed = [futures[f].name for f in done if f.exception() is not None]
            seconds = time.perf_counter() - started
            if late or failed:
                log.warning("aborting %s: %d did not return within %.0fs, %d raised", [c.name for c in batch],
                            len(late), ABORT_BOUND_S, len(failed))
            self._events.emit(Event.GROUPS_ABORTED, groups=sorted(c.name for c in batch), reason=why,
                              s=round(seconds, 6), late=sorted(futures[f].name for f in late), failed=sorted(failed))
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()
