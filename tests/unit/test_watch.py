"""ComputeWatch: a coordinator's command the training thread leaves untaken is reported once, with its stack.

A real thread stands in for the training thread, held in a function of "the script" until the
test lets it go; the watch's checks are called with explicit times (no sleeping on a clock).
"""

from __future__ import annotations

import threading
import time

import pytest

from deadpool.actors.handoff import Handoff
from deadpool.actors.watch import ComputeWatch
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import Prepare, Stop

pytestmark = pytest.mark.timeout(20)


def held_in_a_data_loader(release: threading.Event, started: threading.Event) -> None:
    started.set()
    release.wait(10)


def test_an_untaken_command_is_reported_once_after_the_bound_with_the_threads_stack() -> None:
    handoff, events = Handoff(), EventLog(None)
    events.records = []
    release, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=held_in_a_data_loader, args=(release, started))
    thread.start()
    try:
        assert started.wait(5)
        assert thread.ident is not None
        watch = ComputeWatch(handoff, events, thread.ident, late_after=10.0)
        now = time.monotonic()
        assert not watch.check(now), "nothing delivered: nothing to report"
        handoff.deliver(Prepare(3, [1], "seat 1 lost"))
        assert not watch.check(now + 5.0), "within the bound a step may still be finishing"
        assert watch.check(now + 11.0)
        assert not watch.check(now + 20.0), "each command is reported once"
        late = [r for r in (line.fields() for line in events.records) if r["event"] == Event.COMPUTE_LATE]
        assert len(late) == 1
        assert late[0]["command"] == "Prepare" and late[0]["command_epoch"] == 3 and late[0]["waited_s"] >= 10
        assert "held_in_a_data_loader" in late[0]["stack"]
        handoff.deliver(Stop(False, "the job failed"))
        assert handoff.poll() is not None  # the Prepare taken: the Stop is now the oldest, and is late too
        assert watch.check(time.monotonic() + 11.0)
        late = [r.fields()["command"] for r in events.records if r.event == Event.COMPUTE_LATE]
        assert late == ["Prepare", "Stop"]
        assert handoff.poll() is not None and handoff.untaken() is None
    finally:
        release.set()
        thread.join(5)


def test_a_thread_that_has_ended_is_reported_without_a_stack() -> None:
    handoff, events = Handoff(), EventLog(None)
    events.records = []
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join(5)
    assert thread.ident is not None
    handoff.deliver(Stop(False, "the job failed"))
    assert ComputeWatch(handoff, events, thread.ident, late_after=1.0).check(time.monotonic() + 2.0)
    assert events.records[-1].fields()["stack"] == ""
