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
abort: its communicators are only set aside and left to time out (docs/design/groups.md).
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from deadpool.config import Backend, WorkerEnv
from deadpool.errors import CollectiveAborted, MisuseError, WaitTimeout
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.view import View
from deadpool.worker.exit import GUARD
from deadpool.worker.groups import nccl
from deadpool.worker.groups.standin import StandInGroup

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
            self._events.emit(schema.GroupsAborted(groups=sorted(c.name for c in batch), reason=why,
                              s=round(seconds, 6), late=sorted(futures[f].name for f in late), failed=sorted(failed)))
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()


def connect_store(addr: str, timeout: float) -> TCPStore:
    """Client connection to the coordinator's TCPStore at ``host:port``."""
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def create_group(
    store: Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout: float,
    interrupted: Callable[[], bool],
    connect_timeout: float,
    hostname: str = "127.0.0.1",
    wrap: Callable[[ProcessGroupGloo], Any] | None = None,
) -> Any:
    """Build a gloo group under `prefix`, abandoning the attempt when interrupted.

    The constructor's full-mesh connect cannot be cancelled, so it runs in a
    helper thread; if the caller is interrupted (a newer view is being
    prepared) or the bound expires, the attempt is left behind.

    `hostname` is the address gloo listens on and tells its peers: the
    worker's bind address (``WorkerEnv.bind_host``, set from ``deadpool launch
    --bind-host``), so that peers on other hosts can connect (127.0.0.1 only
    works on one machine).  `wrap` makes the communicator of the gloo group, in the same helper thread
    (NCCL's beside it, or the stand-in around it: ``communicators.py``); None: the gloo group itself.

    Raises:
        CollectiveAborted: interrupted, or the constructor failed (a peer died meanwhile).
        WaitTimeout: the group did not form within `connect_timeout`.
    """
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    result: list[Any] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def build() -> None:
        try:
            gloo = ProcessGroupGloo(PrefixStore(prefix, store), rank, world_size, options)
            result.append(gloo if wrap is None else wrap(gloo))
        except Exception as err:
            failure.append(err)
        finally:
            done.set()

    threading.Thread(target=build, name=f"deadpool-pg-{prefix}", daemon=True).start()
    deadline = time.monotonic() + connect_timeout
    while not done.wait(0.005):
        if interrupted():
            raise CollectiveAborted(f"building group {prefix}", "interrupted by a newer view", interrupted=True)
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"process group {prefix} (rank {rank} of {world_size}) did not form within {connect_timeout:.0f}s; "
                "a peer may have died during the rebuild"
            )
    if failure:
        raise CollectiveAborted(f"building group {prefix}", str(failure[0]))
    return result[0]


class Builder:
    """How this worker builds a view's communicators: of its kind, each on a store connection of its own,
    registered with the communicators, given up on when a newer view comes (`interrupted(epoch)`)."""

    def __init__(self, communicators: Communicators, kind: Kind, device: torch.device | None, timeout: float,
                 bind_host: str, interrupted: Callable[[int], bool], standin_aborts: bool = True) -> None:
        self.communicators = communicators
        self._kind = kind
        self._device = device  # NCCL's CUDA device
        self._timeout = timeout
        self._bind_host = bind_host
        self._interrupted = interrupted
        self._standin_aborts = standin_aborts

    def connect(self, view: View) -> TCPStore:
        """A fresh connection to `view`'s store, kept alive (an abandoned build may still block in a call on it)."""
        store = connect_store(view.store_addr, self._timeout)
        GUARD.retire(store)
        return store

    def for_view(self, view: View) -> Callable[..., Any]:
        """`build(prefix, rank, size, store=None, seats=None)`: one communicator of `view` over `seats` (every seat
        for None).

        Without `store`, the build has a store connection of its own: a TCPStore client runs one call
        at a time, so groups forming at once on one connection would wait behind each other's store
        waits, across processes too (a deadlock until the connect timeout).
        """

        def build(prefix: str, rank: int, size: int, store: Store | None = None,
                  seats: Sequence[int] | None = None) -> Any:
            connection = store if store is not None else self.connect(view)
            wrap, abort = self._communicator(connection, prefix, rank, size)
            group = create_group(connection, prefix, rank, size, self._timeout,
                                 lambda: self._interrupted(view.epoch),
                                 connect_timeout=self._timeout, hostname=self._bind_host, wrap=wrap)
            self.communicators.add(prefix, range(view.world_size) if seats is None else seats, group,
                                   None if abort is None else functools.partial(abort, group))
            return group

        return build

    def _communicator(self, store: Store, prefix: str, rank: int,
                      size: int) -> tuple[Callable[[Any], Any] | None, Callable[[Any], None] | None]:
        """How this worker's kind makes a communicator of a gloo group, and how it aborts one (None: it cannot)."""
        if self._kind is Kind.STANDIN:
            aborts = self._standin_aborts
            return (lambda gloo: StandInGroup(gloo, self._timeout, prefix, aborts)), StandInGroup.abort
        if self._kind is Kind.NCCL:
            device = self._device
            assert device is not None
            return (lambda gloo: nccl.create(store, prefix, rank, size, self._timeout, gloo, device)), nccl.abort
        return None, None
