"""Process groups that can be abandoned, and collectives that can be abandoned.

Facts this module is built on (torch 2.13, gloo, measured on 2-core hosts):

- A SIGKILLed peer makes gloo collectives raise within ~15-100 ms; a SIGSTOPped
  peer blocks them until the group's timeout.  Nothing (``abort``,
  ``shutdown``, ``destroy_process_group``) releases a thread stuck in a gloo
  collective.
- So every collective is issued with ``async_op`` semantics and the compute
  thread waits on a condition that either the collective's completion or an
  interrupt (a Prepare from the membership service) wakes.  An interrupted
  group is never destroyed (that blocks until its op times out); it is
  *retired*: kept referenced and left to time out in the background, while a
  fresh group is built on the long-lived TCPStore under the next epoch's
  prefix.
- Groups are standalone ``ProcessGroupGloo`` objects, not the global default
  group, so rebuilding touches no global state.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from deadpool.errors import WaitTimeout


class CollectiveAborted(Exception):
    """Internal: a collective was abandoned (peer failure or interrupt); the step is poisoned."""

    def __init__(self, what: str, cause: str) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what
        self.cause = cause


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
    hostname: str = "",
) -> ProcessGroupGloo:
    """Build a gloo group under `prefix`, abandoning the attempt when interrupted.

    The constructor's full-mesh connect cannot be cancelled, so it runs in a
    helper thread; if the caller is interrupted (a newer view is being
    prepared) or the bound expires, the attempt is left behind.

    `hostname` is the address gloo listens on and tells its peers; by default
    the worker's bind address (``DEADPOOL_BIND_HOST``, set from ``deadpool
    launch --bind-host``), so that peers on other hosts can connect (127.0.0.1
    only works on one machine).

    Raises:
        CollectiveAborted: interrupted, or the constructor failed (a peer died meanwhile).
        WaitTimeout: the group did not form within `connect_timeout`.
    """
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout)
    device_host = hostname or os.environ.get("DEADPOOL_BIND_HOST") or "127.0.0.1"
    options._devices = [ProcessGroupGloo.create_device(hostname=device_host)]
    result: list[ProcessGroupGloo] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def build() -> None:
        try:
            result.append(ProcessGroupGloo(PrefixStore(prefix, store), rank, world_size, options))
        except Exception as err:
            failure.append(err)
        finally:
            done.set()

    threading.Thread(target=build, name=f"deadpool-pg-{prefix}", daemon=True).start()
    deadline = time.monotonic() + connect_timeout
    while not done.wait(0.005):
        if interrupted():
            raise CollectiveAborted(f"building group {prefix}", "interrupted by a newer view")
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"process group {prefix} (rank {rank} of {world_size}) did not form within {connect_timeout:.0f}s; "
                "a peer may have died during the rebuild"
            )
    if failure:
        raise CollectiveAborted(f"building group {prefix}", str(failure[0]))
    return result[0]


class Waiter:
    """Wakes the compute thread when a collective completes or an interrupt arrives.

    Both sources notify the same condition (the Handoff's), so one wait covers
    both without polling.
    """

    def __init__(self, condition: threading.Condition, interrupted: Callable[[], bool]) -> None:
        self._condition = condition
        self._interrupted = interrupted

    def wait(self, work: dist.Work, what: str, bound: float) -> None:
        """Wait for `work`, giving up on interrupt or after `bound` seconds.

        Raises:
            CollectiveAborted: the collective failed (peer died), was interrupted, or timed out.
        """
        finished = threading.Event()
        future = work.get_future()

        def on_done(_: torch.futures.Future[object]) -> None:
            finished.set()
            with self._condition:
                self._condition.notify_all()

        future.add_done_callback(on_done)
        deadline = time.monotonic() + bound
        with self._condition:
            while not finished.is_set():
                if self._interrupted():
                    raise CollectiveAborted(what, "interrupted by the membership service")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveAborted(what, f"no completion within {bound:.1f}s")
                self._condition.wait(min(remaining, 0.5))
        try:
            work.wait()
        except RuntimeError as err:
            raise CollectiveAborted(what, str(err).splitlines()[0] if str(err) else repr(err)) from err
