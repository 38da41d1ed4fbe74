"""The communicators' decisions without a GPU: which kind a worker builds, NCCL's settings, which communicators a
lost seat aborts and how (together, off the caller's thread), and the stand-in's hang, on fake gloo works."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from deadpool.config import Backend
from deadpool.errors import MisuseError
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.worker.groups import nccl, standin
from deadpool.worker.groups.communicators import Communicators, Kind, choose


def test_the_kind_follows_the_backend_and_what_the_machine_has() -> None:
    assert choose(Backend.AUTO, cuda=True, nccl=True, standin=False)[0] is Kind.NCCL
    assert choose(Backend.AUTO, cuda=False, nccl=False, standin=False)[0] is Kind.GLOO
    assert choose(Backend.AUTO, cuda=True, nccl=False, standin=False)[0] is Kind.GLOO
    assert choose(Backend.GLOO, cuda=True, nccl=True, standin=False)[0] is Kind.GLOO
    assert choose(Backend.NCCL, cuda=True, nccl=True, standin=False)[0] is Kind.NCCL
    assert choose(Backend.GLOO, cuda=False, nccl=False, standin=True)[0] is Kind.STANDIN  # the test aid wins
    with pytest.raises(MisuseError, match="no CUDA device"):
        choose(Backend.NCCL, cuda=False, nccl=False, standin=False)
    with pytest.raises(MisuseError, match="no NCCL"):
        choose(Backend.NCCL, cuda=True, nccl=False, standin=False)


def test_nccl_settings_keep_the_watchdog_from_ending_a_process_deadpool_repairs() -> None:
    settings, warnings = nccl.env_settings({}, collective_timeout=10.0)
    values = {s.name: s.value for s in settings}
    assert values["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert values["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert int(values["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) > 10, "the heartbeat monitor waits past the timeout"
    assert values["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "10"
    assert not warnings and all(s.why for s in settings)
    # A user's own value is kept; one that lets the watchdog tear the process down is named.
    settings, warnings = nccl.env_settings({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}, collective_timeout=10.0)
    assert {s.name for s in settings}.isdisjoint({"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"})
    assert len(warnings) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in warnings[0]


def test_aborts_start_in_one_order_on_every_seat() -> None:
    assert nccl.abort_order(["epoch-3/mesh/deadpool:tp:1", "epoch-3", "epoch-3/mesh/deadpool:dp:0"]) == [
        "epoch-3", "epoch-3/mesh/deadpool:dp:0", "epoch-3/mesh/deadpool:tp:1"]


class Abort:
    """A communicator's abort that records when and on which thread it ran, and can take a while."""

    def __init__(self, log: list[tuple[str, float, str]], name: str, seconds: float = 0.0) -> None:
        self._log, self._name, self._seconds = log, name, seconds

    def __call__(self) -> None:
        started = time.perf_counter()
        time.sleep(self._seconds)
        self._log.append((self._name, started, threading.current_thread().name))


def test_a_lost_seat_aborts_together_every_communicator_holding_it_and_nothing_else() -> None:
    events = EventLog(None)
    events.records = []
    communicators = Communicators(events)
    log: list[tuple[str, float, str]] = []
    world, dp0, tp1 = object(), object(), object()
    communicators.add("epoch-2", range(4), world, Abort(log, "epoch-2", 0.2))
    communicators.add("epoch-2/mesh/deadpool:dp:0", (0, 2), dp0, Abort(log, "dp", 0.2))
    communicators.add("epoch-2/mesh/deadpool:tp:1", (2, 3), tp1, Abort(log, "tp", 0.2))
    gloo = object()
    communicators.add("epoch-2/mesh/gloo", (0, 1), gloo, None)  # gloo: cannot abort
    started = time.perf_counter()
    communicators.abort_holding({0}, "seat 0 lost")
    assert time.perf_counter() - started < 0.1, "the caller (the runtime thread's loop) does not wait for them"
    assert not communicators.usable(world) and not communicators.usable(dp0), "nothing more is issued on them"
    assert communicators.usable(tp1) and communicators.usable(gloo)
    assert communicators.wait_idle(5.0)
    assert sorted(name for name, _, _ in log) == ["dp", "epoch-2"]
    starts = [when for _, when, _ in log]
    assert max(starts) - min(starts) < 0.15, "the batch's aborts run at once, not one after another"
    assert all(thread.startswith("deadpool-abort") for _, _, thread in log)
    [record] = [r for r in (line.fields() for line in events.records) if r["event"] == Event.GROUPS_ABORTED]
    assert record["groups"] == ["epoch-2", "epoch-2/mesh/deadpool:dp:0"] and record["reason"] == "seat 0 lost"
    assert record["s"] >= 0.2 and record["late"] == [] and record["failed"] == []
    # A communicator set aside by a rebuild is aborted too; an aborted one is not aborted again.
    communicators.retire(tp1)
    communicators.retire(world)
    assert communicators.wait_idle(5.0)
    assert sorted(name for name, _, _ in log) == ["dp", "epoch-2", "tp"]
    # A Prepare naming no seat (a rebuild with nobody found dead): every live one.
    other = object()
    communicators.add("epoch-3", range(4), other, Abort(log, "epoch-3"))
    communicators.abort_holding((), "no seat named")
    assert communicators.wait_idle(5.0) and log[-1][0] == "epoch-3"


class FakeWork(dist.Work):
    """A gloo work that completes after `seconds`, or fails then (its peer died)."""

    def __init__(self, seconds: float, fails: bool) -> None:
        super().__init__()
        self._at, self._fails = time.monotonic() + seconds, fails

    def wait(self, timeout: timedelta | None = None) -> bool:
        time.sleep(max(0.0, self._at - time.monotonic()))
        if self._fails:
            raise RuntimeError("Connection closed by peer")
        return True


class FakeGloo:
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def allreduce(self, *args: Any) -> dist.Work:
        return FakeWork(0.01, self.fails)

    def barrier(self, *args: Any) -> dist.Work:
        return FakeWork(0.0, False)


def test_the_standin_hangs_where_nccl_does_and_the_abort_releases_it() -> None:
    healthy = standin.StandInGroup(FakeGloo(fails=False), timeout=5.0, name="ok")
    work = healthy.allreduce([])
    assert work.wait(timedelta(seconds=2)) and work.is_completed()
    broken = standin.StandInGroup(FakeGloo(fails=True), timeout=30.0, name="broken")
    stuck = broken.allreduce([])
    with pytest.raises(RuntimeError, match="not completed"):
        stuck.wait(timedelta(seconds=0.3))  # its peer died: no error, no completion (gloo would have raised)
    assert not stuck.is_completed()
    # It holds the device: a collective on another communicator waits behind it ...
    issued = threading.Event()
    threading.Thread(target=lambda: (healthy.barrier(), issued.set()), daemon=True).start()
    assert not issued.wait(0.3)
    broken.abort()  # ... until the stuck one is aborted: it fails, and the device is free
    with pytest.raises(RuntimeError, match="aborted"):
        stuck.wait(timedelta(seconds=2))
    assert issued.wait(2.0)
    later = broken.allreduce([])  # an aborted communicator is never used again: its works fail at once
    with pytest.raises(RuntimeError, match="aborted"):
        later.wait(timedelta(seconds=2))


def test_without_an_abort_the_standin_waits_out_the_collective_timeout() -> None:
    broken = standin.StandInGroup(FakeGloo(fails=True), timeout=0.5, name="unaborted", abortable=False)
    started = time.monotonic()
    stuck = broken.allreduce([])
    broken.abort()  # switched off: nothing happens
    with pytest.raises(RuntimeError, match="timed out after"):
        stuck.wait(timedelta(seconds=5))
    assert time.monotonic() - started >= 0.5
