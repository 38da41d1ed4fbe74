"""A ZeroMQ transport reaches more peers than libzmq's default socket limit (1,023 per context).

The coordinator sends to every member's own control address, one PUSH socket per
address (``transports/zmq_transport.py``).  With libzmq's default limit, a job of more
than about a thousand members left the rest unreachable: their sends failed with "Too
many open files" (found by the swarm benchmark, ``bench/swarm.py``).  The context's
limit now follows the process's descriptor limit.
"""

from __future__ import annotations

import asyncio
import resource

import pytest
import zmq
from deadpool.transports import zmq_transport

from deadpool.protocol.transport import CONTROL_LIMITS, TransportError

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

PEERS = 1100  # past libzmq's default of 1,023 sockets per context


async def test_the_context_allows_as_many_sockets_as_descriptors() -> None:
    transport = zmq_transport.ZmqTransport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        context = zmq_transport.shared_context()
        expected = context.get(zmq.SOCKET_LIMIT) if soft == resource.RLIM_INFINITY else soft
        assert context.get(zmq.MAX_SOCKETS) == max(1023, min(expected, context.get(zmq.SOCKET_LIMIT)))
    finally:
        await transport.close()


async def test_a_sender_reaches_a_peer_after_more_than_a_thousand_others() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * PEERS + 100:
        pytest.skip(f"the descriptor limit ({soft}) is too low for {PEERS} peers")
    sender = zmq_transport.ZmqTransport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    receiver = zmq_transport.ZmqTransport("tcp://127.0.0.1:0", CONTROL_LIMITS)
    reader = asyncio.create_task(receiver.run())
    try:
        for port in range(1, PEERS + 1):  # nobody speaks ZeroMQ there: each send times out, none is refused
            with pytest.raises(TransportError, match="not accepted within"):
                await sender.send(f"tcp://127.0.0.1:{port}", [b"x"], 0.001)
        await sender.send(receiver.address, [b"hello"], 2.0)
        frames = await asyncio.wait_for(receiver.recv(), 2.0)
        assert bytes(frames[0]) == b"hello"
    finally:
        await sender.close()
        await receiver.close()
        await asyncio.wait_for(reader, 2.0)
