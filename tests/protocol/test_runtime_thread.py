"""The runtime thread's routing and shutdown, with real ZeroMQ sockets on 127.0.0.1 (no processes started).

Stopping is a message ordered after what the compute thread posted before it:
a seat posts ``Finished`` and calls ``rt.finish()`` right after, and the
coordinator must still hear it.  Before the order was kept, the stop could
close the control socket first (about half the time in a tight loop), and the
job was declared failed although every seat had finished.
"""

from __future__ import annotations

import asyncio

import pytest

from deadpool.actors.handoff import Handoff, PrepareReady, Progress
from deadpool.actors.runtime_thread import RuntimeThread
from deadpool.chaos import inject, parse
from deadpool.config import Config
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import Finished, Message, PrepareAck
from deadpool.protocol.transport import CONTROL_LIMITS, Transport, open_transport

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

ROUNDS = 10


async def test_finished_posted_right_before_stop_reaches_the_coordinator() -> None:
    coordinator = open_transport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    reader = asyncio.create_task(coordinator.run())
    try:
        for round_ in range(ROUNDS):
            member = f"member-{round_}"
            handoff = Handoff()
            thread = RuntimeThread(member, coordinator.address, "127.0.0.1", Config(), handoff, Progress(),
                                   EventLog(None))
            thread.start()
            handoff.post(Finished(member, 1, 0, 39, "ab" * 32))
            await asyncio.to_thread(thread.stop, 5.0)
            frames = await asyncio.wait_for(coordinator.recv(), 2.0)
            message = codec.decode(frames[0], None)
            assert isinstance(message, Finished) and message.sender == member, message
    finally:
        await coordinator.close()
        await asyncio.wait_for(reader, 2.0)


async def _next_message(transport: Transport, timeout: float = 2.0) -> Message:
    frames = await asyncio.wait_for(transport.recv(), timeout)
    message = codec.decode(frames[0], None)
    assert not isinstance(message, codec.DecodeError), message
    return message


async def test_flush_returns_after_the_prepare_ack_it_follows_was_handed_over() -> None:
    """The compute thread says what it holds (PrepareReady); the snapshot actor completes the PrepareAck
    with its ward copies (none here); a flush posted after it returns only once the ack was handed over."""
    coordinator = open_transport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    reader = asyncio.create_task(coordinator.run())
    handoff = Handoff()
    thread = RuntimeThread("m1", coordinator.address, "127.0.0.1", Config(), handoff, Progress(), EventLog(None))
    thread.start()
    try:
        handoff.post(PrepareReady(3, 17, 17, [16, 17], [10]))
        assert await asyncio.to_thread(handoff.flush, 5.0)
        message = await _next_message(coordinator)
        assert message == PrepareAck("m1", 3, 17, [16, 17], {}, [10])
    finally:
        await asyncio.to_thread(thread.stop, 5.0)
        await coordinator.close()
        await asyncio.wait_for(reader, 2.0)


@pytest.mark.parametrize("partitionable", [False, True])
async def test_only_a_member_with_a_partition_spec_has_its_transports_behind_the_switch(partitionable: bool) -> None:
    coordinator = open_transport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    reader = asyncio.create_task(coordinator.run())
    handoff = Handoff()
    thread = RuntimeThread("m1", coordinator.address, "127.0.0.1", Config(), handoff, Progress(), EventLog(None),
                           partitionable=partitionable)
    thread.start()
    try:
        handoff.post(Finished("m1", 1, 0, 1, "ab" * 32))
        assert isinstance(await _next_message(coordinator), Finished)
        inject(parse("partition:rank=0:step=1"), thread.partition)
        handoff.post(Finished("m1", 1, 0, 2, "cd" * 32))
        assert await asyncio.to_thread(handoff.flush, 5.0)
        if partitionable:
            with pytest.raises(TimeoutError):
                await _next_message(coordinator, timeout=0.5)  # the cut link lost it
        else:
            message = await _next_message(coordinator)  # no wrapper: the switch cuts nothing
            assert isinstance(message, Finished) and message.step == 2
    finally:
        await asyncio.to_thread(thread.stop, 5.0)
        await coordinator.close()
        await asyncio.wait_for(reader, 2.0)
