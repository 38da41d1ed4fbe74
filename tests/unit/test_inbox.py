"""The actors' Mailbox: local commands first, never refused, however full the peer lane is."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deadpool.actors.inbox import LOCAL_BACKLOG_WARNING, Mailbox

pytestmark = pytest.mark.timeout(10)


async def test_local_items_are_served_before_peer_items_and_each_lane_keeps_its_order() -> None:
    box: Mailbox[str, int] = Mailbox("test", peer_size=4)
    for n in range(3):
        await box.put(n)
    box.post("a")
    box.post("b")
    assert [await box.get() for _ in range(5)] == ["a", "b", 0, 1, 2]
    assert box.qsize() == (0, 0)


async def test_a_full_peer_lane_pushes_back_on_its_reader_but_never_on_a_local_post() -> None:
    box: Mailbox[str, int] = Mailbox("test", peer_size=2)
    await box.put(0)
    await box.put(1)
    blocked = asyncio.create_task(box.put(2))
    await asyncio.sleep(0.01)
    assert not blocked.done(), "a full peer lane makes the reader wait"
    for n in range(10):
        box.post(f"command-{n}")  # never raises, never waits
    assert box.qsize() == (10, 2)
    got = [await box.get() for _ in range(13)]
    assert got == [f"command-{n}" for n in range(10)] + [0, 1, 2]
    await asyncio.wait_for(blocked, 1.0)


async def test_get_waits_for_either_lane() -> None:
    box: Mailbox[str, int] = Mailbox("test", peer_size=2)
    waiting = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    box.post("x")
    assert await asyncio.wait_for(waiting, 1.0) == "x"
    waiting = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    await box.put(7)
    assert await asyncio.wait_for(waiting, 1.0) == 7


async def test_take_local_empties_the_local_lane_only() -> None:
    box: Mailbox[str, int] = Mailbox("test", peer_size=2)
    box.post("a")
    await box.put(1)
    box.post("b")
    assert box.take_local() == ["a", "b"]
    assert box.qsize() == (0, 1) and await box.get() == 1


async def test_a_stuck_actor_is_logged_once_per_backlog_and_nothing_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box: Mailbox[int, int] = Mailbox("stuck actor", peer_size=1)
    with caplog.at_level(logging.ERROR, logger="deadpool.actors.inbox"):
        for n in range(LOCAL_BACKLOG_WARNING + 50):
            box.post(n)
    assert [r.getMessage() for r in caplog.records] == [f"stuck actor: {LOCAL_BACKLOG_WARNING + 1} local commands "
                                                        "waiting; the actor is stuck"]
    assert box.take_local() == list(range(LOCAL_BACKLOG_WARNING + 50))
