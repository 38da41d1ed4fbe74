"""The Handoff between the compute thread and the runtime thread, without a runtime thread.

A stand-in runtime thread takes what the compute side posts, in order, and
hands each message "to the transport" (a list); ``Drain`` markers are
answered once what came before them was handed over, as the membership actor
does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from deadpool.actors.handoff import MAX_COMMANDS, Handoff
from deadpool.actors.inbox import Drain
from deadpool.errors import WaitTimeout
from deadpool.protocol.messages import CommitView, Fenced, Prepare, Stop
from deadpool.protocol.view import View

pytestmark = pytest.mark.timeout(20)


def _view(epoch: int) -> View:
    return View(epoch, ["m0", "m1"], [], -1, f"epoch-{epoch}", "127.0.0.1:1", {}, {}, [1, 0], {})


class FakeRuntime:
    """Takes posts on its own thread, in order; holds each one for `delay` seconds before 'sending' it."""

    def __init__(self, handoff: Handoff, delay: float = 0.0) -> None:
        self.sent: list[Any] = []
        self.delay = delay
        self.paused = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        handoff.bind(self._queue.put)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            while self.paused.is_set():
                time.sleep(0.001)
            if isinstance(item, Drain):
                item.done()
            else:
                time.sleep(self.delay)
                self.sent.append(item)

    def close(self) -> None:
        self.paused.clear()
        self._queue.put(None)
        self._thread.join(5.0)


@pytest.fixture
def handoff() -> Iterator[Handoff]:
    yield Handoff()


def test_flush_returns_once_every_earlier_post_was_handed_over(handoff: Handoff) -> None:
    runtime = FakeRuntime(handoff, delay=0.02)
    try:
        for n in range(5):
            handoff.post(("report", n))
        assert handoff.flush(5.0)
        assert runtime.sent == [("report", n) for n in range(5)], "flush returned before the posts were handed over"
    finally:
        runtime.close()


def test_flush_is_bounded_and_says_when_it_timed_out(handoff: Handoff) -> None:
    runtime = FakeRuntime(handoff)
    runtime.paused.set()  # a runtime thread that makes no progress
    try:
        handoff.post("report")
        started = time.monotonic()
        assert handoff.flush(0.2) is False
        assert 0.2 <= time.monotonic() - started < 2.0
        runtime.paused.clear()
        assert handoff.flush(5.0), "a later flush succeeds once the runtime thread moves again"
        assert runtime.sent == ["report"]
    finally:
        runtime.close()


def test_posts_fail_at_once_without_a_runtime_thread(handoff: Handoff) -> None:
    with pytest.raises(RuntimeError, match="not running"):
        handoff.post("report")
    with pytest.raises(RuntimeError, match="not running"):
        handoff.flush(5.0)
    runtime = FakeRuntime(handoff)
    runtime.close()
    handoff.bind(None)  # what the runtime thread does when it ends
    with pytest.raises(RuntimeError, match="not running"):
        handoff.post("report")


def test_commands_are_taken_in_order_and_a_wait_for_one_is_bounded(handoff: Handoff) -> None:
    prepare, commit = Prepare(2, [1], "m1 died"), CommitView(_view(2))
    handoff.deliver(prepare)
    handoff.deliver(commit)
    assert handoff.take(1.0, "test") == prepare
    assert handoff.poll() == commit and handoff.poll() is None
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="while paused for the test"):
        handoff.take(0.1, "paused for the test")
    assert time.monotonic() - started < 1.5


def test_a_newer_prepare_or_a_terminal_command_interrupts_the_step(handoff: Handoff) -> None:
    assert not handoff.interrupted(1)
    handoff.deliver(Prepare(2, [1], "m1 died"))
    assert handoff.interrupted(1) and not handoff.interrupted(2)
    handoff.deliver(Fenced("m1", 3, "declared dead"))
    assert handoff.interrupted(5) and isinstance(handoff.terminal, Fenced)


def test_overflowing_commands_drop_the_oldest_but_keep_the_terminal_state(handoff: Handoff) -> None:
    handoff.deliver(Stop(False, "the job failed"))
    for epoch in range(1, MAX_COMMANDS + 5):
        handoff.deliver(Prepare(epoch, [1], "m1 died"))
    assert handoff.dropped_commands == 5
    assert isinstance(handoff.terminal, Stop) and handoff.terminal.reason == "the job failed"
    first = handoff.poll()
    assert isinstance(first, Prepare) and first.epoch == 5


def test_confirmations_are_per_generation_and_old_ones_are_forgotten(handoff: Handoff) -> None:
    for step in range(10):
        handoff.confirm("epoch-1", step)
    assert handoff.is_confirmed("epoch-1", 9) and handoff.is_confirmed("epoch-1", 5)
    assert not handoff.is_confirmed("epoch-2", 9), "a confirmation counts only in its own group generation"
    assert not handoff.is_confirmed("epoch-1", 0), "steps long superseded are dropped"


def test_wait_until_returns_when_the_condition_holds_or_false_when_interrupted(handoff: Handoff) -> None:
    done: list[bool] = []
    waker = threading.Timer(0.05, lambda: (done.append(True), handoff.wake()))
    waker.start()
    assert handoff.wait_until(lambda: bool(done), epoch=1, timeout=5.0, what="test")
    threading.Timer(0.05, lambda: handoff.deliver(Prepare(2, [1], "m1 died"))).start()
    assert handoff.wait_until(lambda: False, epoch=1, timeout=5.0, what="test") is False
    with pytest.raises(WaitTimeout, match="nothing: not done within"):
        handoff.wait_until(lambda: False, epoch=2, timeout=0.1, what="nothing")


def test_a_mesh_group_loses_a_seat_only_to_a_prepare_that_names_it() -> None:
    handoff = Handoff()
    assert not handoff.lost_any(1, [0, 2])
    handoff.deliver(Prepare(2, [3], "seat 3 lost"))
    assert not handoff.lost_any(1, [0, 2]), "another group's seat"
    assert handoff.lost_any(1, [2, 3])
    assert not handoff.lost_any(2, [2, 3]), "not newer than the view the collective runs under"
    handoff.deliver(Prepare(3, [], "a rebuild that names no seat"))
    assert handoff.lost_any(2, [0, 2])


def test_a_mesh_wait_stops_for_a_peer_that_paused_before_its_step() -> None:
    """Seat 3 shares no group with the dead seat 0, finished step 11 and waits in step 12 on a group with
    seat 1, which paused after its (lost) step 11: that wait can never complete."""
    handoff = Handoff()
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 12)
    handoff.peer_paused("m1", 2, 11)  # paused for Prepare(2) after the lost step 11, which it ran to its end
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 12)
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 11), "it issued every collective of step 11"
    assert not handoff.peer_stopped_before(1, ["m2", "m3"], 12), "another group's member"
    assert not handoff.peer_stopped_before(2, ["m1", "m3"], 12), "not newer than the view the wait runs under"


def test_a_mesh_wait_stops_for_a_peer_that_took_the_prepare_at_the_boundary_before_it() -> None:
    """Seat 3 finished step 19 just as the Prepare came and paused there, never beginning step 20; seat 1,
    which shares only healthy groups with it, waits in step 20's first all-gather.  That wait can never
    complete: it must end at the pause notice, not at the group timeout (a bench run lost the job so)."""
    handoff = Handoff()
    handoff.peer_paused("m3", 2, 19)  # began no step after 19
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 20)
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 19), "it issued every collective of step 19"


def test_a_mesh_wait_past_the_forward_stops_for_a_peer_that_abandoned_that_steps_backward() -> None:
    """Seat 1 stopped step 12's backward before its first collective: it issued all of that step's forward
    collectives (a wait on one of them completes) and none after it (a wait on one of those cannot)."""
    handoff = Handoff()
    handoff.peer_paused("m1", 2, 12, abandoned=True)
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 12), "a forward collective: it issued it"
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 12, past_forward=True)
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 13)
    handoff.peer_paused("m1", 2, 12)  # ran step 12 to its end
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 12, past_forward=True)


def test_any_mesh_wait_of_the_step_stops_for_a_peer_that_stopped_that_steps_forward() -> None:
    """Seat 1 stopped step 12's forward at a submodule: a forward collective it had not reached is never
    issued either, so every wait of step 12 on it ends, the forward's too."""
    handoff = Handoff()
    handoff.peer_paused("m1", 2, 12, abandoned=True, in_forward=True)
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 12)
    assert handoff.peer_stopped_before(1, ["m1", "m3"], 12, past_forward=True)
    assert not handoff.peer_stopped_before(1, ["m2", "m3"], 12), "another group's member"
    assert not handoff.peer_stopped_before(1, ["m1", "m3"], 11), "it issued every collective of step 11"
