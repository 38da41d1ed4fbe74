"""The runtime thread's shutdown, with real ZeroMQ sockets on 127.0.0.1 (no processes started).

Stopping is a message ordered after what the compute thread posted before it:
a seat posts ``Finished`` and calls ``rt.finish()`` right after, and the
coordinator must still hear it.  Before the order was kept, the stop could
close the control socket first (about half the time in a tight loop), and the
job was declared failed although every seat had finished.
"""

from __future__ import annotations

import asyncio

import pytest

from deadpool.actors.handoff import Handoff, Progress
from deadpool.actors.runtime_thread import RuntimeThread
from deadpool.config import Config
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import Finished
from deadpool.protocol.transport import CONTROL_LIMITS, open_transport

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
