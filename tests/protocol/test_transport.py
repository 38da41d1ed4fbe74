"""One conformance suite for every transport: tcp://, ipc:// (ZeroMQ), inproc://, and the partition
wrapper (over inproc://, not cut) that chaos specs use.

Actors only see the ``Transport`` protocol, so every implementation must keep
the same promises (``deadpool/protocol/transport.py``): messages arrive whole and in
order; frames over ``Limits.max_frame_bytes`` and messages over
``Limits.max_frames`` never reach ``recv()``; a full inbox pushes back on
senders instead of growing; every send is bounded by its timeout and fails
with ``TransportError``; ``close()`` is idempotent, makes ``run()`` return and
later sends fail with ``TransportClosed``.  As trio runs one stream suite against every stream type,
each test here runs against each transport.

The ``endpoints`` fixture owns every transport and reader task a test opens:
at teardown it closes them, checks that every ``run()`` returned on its own
(no reader left blocked), and that no ZeroMQ socket was left open (an open
socket is what would keep the context from terminating).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import socket
import struct
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_asyncio
import zmq
import zmq.utils.garbage
from deadpool.transports import zmq_transport
from deadpool.transports.partitioned import PartitionedTransport, PartitionSwitch

from deadpool.protocol.transport import Frame, Limits, Transport, TransportClosed, TransportError, open_transport

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]

KINDS = ["tcp", "ipc", "inproc", "partitioned"]
RECV_TIMEOUT = 2.0  # generous bound for a message on loopback; never reached when healthy
QUIET = 0.2  # how long "nothing more arrives" is watched

# ipc paths are never reused within a run: ZeroMQ tears a closed listener down
# asynchronously and then unlinks its socket file, which would delete the file
# of a new endpoint bound to the same path in the meantime.
_IPC_NAMES = itertools.count()


class Endpoints:
    """Opens transports of one kind for a test and tears all of them down."""

    def __init__(self, kind: str, ipc_dir: Path) -> None:
        self.kind = kind
        self.scheme = "inproc" if kind == "partitioned" else kind  # the URL scheme of what is opened
        self.switch = PartitionSwitch()  # for kind "partitioned": every transport opened sits behind it
        self._ipc_dir = ipc_dir
        self._transports: list[Transport] = []
        self._readers: list[asyncio.Task[None]] = []

    def fresh_url(self) -> str:
        """A bindable URL nobody else uses (random port, private path, unique name)."""
        if self.scheme == "tcp":
            return "tcp://127.0.0.1:0"
        if self.scheme == "ipc":
            return f"ipc://{self._ipc_dir}/ep{next(_IPC_NAMES)}"
        return f"inproc://test-{uuid.uuid4().hex}"

    def unused_address(self) -> str:
        """An address nobody listens on."""
        if self.scheme == "tcp":
            with socket.socket() as probe:  # a port that was free a moment ago
                probe.bind(("127.0.0.1", 0))
                return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        if self.scheme == "ipc":
            return f"ipc://{self._ipc_dir}/nobody-{next(_IPC_NAMES)}"
        return f"inproc://nobody-{uuid.uuid4().hex}"

    def open(self, limits: Limits | None = None, *, url: str | None = None, run: bool = True) -> Transport:
        """Bind a transport and (by default) start its reader."""
        transport = open_transport(url or self.fresh_url(), limits)
        if self.kind == "partitioned":
            transport = PartitionedTransport(transport, self.switch)
        self._transports.append(transport)
        if run:
            self.start(transport)
        return transport

    def start(self, transport: Transport) -> asyncio.Task[None]:
        """Start `transport.run()`; the task is owned here and awaited at teardown."""
        task = asyncio.create_task(transport.run(), name=f"run {transport.address}")
        self._readers.append(task)
        return task

    async def aclose(self) -> None:
        """Close every transport, then require every reader to have returned by itself."""
        for transport in self._transports:
            await transport.close()
        stuck: list[str] = []
        for task in self._readers:
            try:
                await asyncio.wait_for(asyncio.shield(task), RECV_TIMEOUT)
            except TimeoutError:
                stuck.append(task.get_name())
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        assert not stuck, f"run() did not return after close(): {stuck}"
        for task in self._readers:
            assert not task.cancelled(), f"{task.get_name()} ended cancelled instead of returning"
            assert task.exception() is None, f"{task.get_name()} crashed: {task.exception()!r}"
        if self.scheme in ("tcp", "ipc"):
            # Context._sockets is pyzmq's own registry (what Context.destroy() walks);
            # an open socket here would block Context.term().
            left_open = [s for s in list(zmq_transport.shared_context()._sockets) if not s.closed]
            assert not left_open, f"{len(left_open)} ZeroMQ sockets left open"


@pytest.fixture(scope="module")
def ipc_dir() -> Iterator[Path]:
    """A short private directory: unix socket paths must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dp-ipc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture(params=KINDS)
async def endpoints(request: pytest.FixtureRequest, ipc_dir: Path) -> AsyncIterator[Endpoints]:
    owner = Endpoints(request.param, ipc_dir)
    try:
        yield owner
    finally:
        await owner.aclose()


async def recv_within(transport: Transport, timeout: float = RECV_TIMEOUT) -> list[bytes]:
    """The next message as bytes; fails the test (instead of hanging) if none comes."""
    message = await asyncio.wait_for(transport.recv(), timeout)
    return [bytes(frame) for frame in message]


async def assert_quiet(transport: Transport, seconds: float = QUIET) -> None:
    """Nothing (more) reaches recv() for a while; the cancelled inbox read loses nothing."""
    with pytest.raises(asyncio.TimeoutError):
        got = await asyncio.wait_for(transport.recv(), seconds)
        pytest.fail(f"unexpected message of {[len(f) for f in got]} bytes")


def sequenced(n: int, payload: bytes) -> list[Frame]:
    return [struct.pack("!Q", n), payload]


# --- delivery ---------------------------------------------------------------------------------


async def test_is_a_transport_with_a_concrete_address(endpoints: Endpoints) -> None:
    transport = endpoints.open()
    assert isinstance(transport, Transport)
    assert transport.address.startswith(f"{endpoints.scheme}://")
    if endpoints.scheme == "tcp":
        assert not transport.address.endswith(":0")
    assert transport.dropped() == 0


async def test_round_trip_single_frame(endpoints: Endpoints) -> None:
    receiver, sender = endpoints.open(), endpoints.open()
    await sender.send(receiver.address, [b"hello"], timeout=RECV_TIMEOUT)
    received = await asyncio.wait_for(receiver.recv(), RECV_TIMEOUT)
    assert all(isinstance(frame, memoryview) for frame in received)
    assert [bytes(frame) for frame in received] == [b"hello"]


async def test_round_trip_multi_frame_of_every_buffer_type(endpoints: Endpoints) -> None:
    limits = Limits(max_frames=5)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    typed = cast(memoryview, memoryview(bytes(range(64))).cast("d"))  # 8 items, 64 bytes: size is nbytes
    frames: list[Frame] = [b"header", b"", bytearray(b"\x00\xff" * 1000), memoryview(b"view"), typed]
    await sender.send(receiver.address, frames, timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [bytes(f) for f in frames]


async def test_messages_from_one_sender_arrive_in_order(endpoints: Endpoints) -> None:
    receiver, sender = endpoints.open(), endpoints.open()
    for n in range(50):
        await sender.send(receiver.address, sequenced(n, b"x" * n), timeout=RECV_TIMEOUT)
    for n in range(50):
        assert await recv_within(receiver) == [struct.pack("!Q", n), b"x" * n]
    await assert_quiet(receiver)


async def test_a_burst_longer_than_a_drain_arrives_whole_and_in_order(endpoints: Endpoints) -> None:
    """The ZeroMQ reader takes what is queued without waiting, DRAIN_BATCH messages at a time: a burst of
    several batches loses nothing and keeps its order."""
    receiver, sender = endpoints.open(), endpoints.open()
    count = 3 * zmq_transport.DRAIN_BATCH + 7

    async def burst() -> None:
        for n in range(count):
            await sender.send(receiver.address, sequenced(n, b"y"), timeout=RECV_TIMEOUT)

    sending = asyncio.create_task(burst())
    assert [struct.unpack("!Q", (await recv_within(receiver))[0])[0] for _ in range(count)] == list(range(count))
    await sending
    await assert_quiet(receiver)


async def test_sends_issued_together_behind_a_full_queue_keep_their_order(endpoints: Endpoints) -> None:
    """As the coordinator sends (a task per message): once one send to a peer waits for room, later sends to it
    queue behind that one, even when room comes before they are issued (no later message overtakes)."""
    limits = Limits(inbox_size=4, send_hwm=2)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    payload = b"\x00" * (64 << 10)

    def send(n: int) -> asyncio.Task[None]:
        return asyncio.create_task(sender.send(receiver.address, sequenced(n, payload), timeout=10.0))

    first = [send(n) for n in range(400)]  # 25 MB: far more than the HWMs and kernel buffers hold, most wait
    await asyncio.sleep(0.2)
    assert not all(task.done() for task in first), "the queue never filled: nothing here waited"
    got = [struct.unpack("!Q", (await recv_within(receiver))[0])[0] for _ in range(5)]  # room again
    later = [send(n) for n in range(400, 410)]
    got += [struct.unpack("!Q", (await recv_within(receiver))[0])[0] for _ in range(405)]
    await asyncio.gather(*first, *later)
    assert got == list(range(410))
    await assert_quiet(receiver)


async def test_many_senders_reach_one_receiver(endpoints: Endpoints) -> None:
    receiver = endpoints.open()
    senders = [endpoints.open() for _ in range(4)]
    for index, sender in enumerate(senders):
        await sender.send(receiver.address, [bytes([index])], timeout=RECV_TIMEOUT)
    got = sorted([(await recv_within(receiver))[0] for _ in senders])
    assert got == [bytes([index]) for index in range(len(senders))]


async def test_a_frame_of_exactly_max_frame_bytes_arrives(endpoints: Endpoints) -> None:
    limits = Limits(max_frame_bytes=4096)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    await sender.send(receiver.address, [b"\x07" * 4096], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"\x07" * 4096]
    assert receiver.dropped() == 0


async def test_recv_timeout_loses_nothing(endpoints: Endpoints) -> None:
    """Timeouts go on the inbox read: cancelling recv() must not drop a message."""
    receiver, sender = endpoints.open(), endpoints.open()
    for _ in range(3):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(receiver.recv(), 0.02)
    await sender.send(receiver.address, [b"late"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"late"]


async def test_forget_then_send_again(endpoints: Endpoints) -> None:
    receiver, sender = endpoints.open(), endpoints.open()
    await sender.send(receiver.address, [b"one"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"one"]
    sender.forget(receiver.address)
    sender.forget(endpoints.unused_address())  # forgetting a stranger is harmless
    await sender.send(receiver.address, [b"two"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"two"]


# --- limits -----------------------------------------------------------------------------------

OVERSIZED_SHAPES: dict[str, Callable[[], list[Frame]]] = {
    "one-frame": lambda: [b"\x01" * 4097],
    "typed-view": lambda: [cast(memoryview, memoryview(bytes(8 * 1024)).cast("d"))],  # len 1024, nbytes 8192
    "last-of-three": lambda: [b"a", b"b", b"\x01" * 5000],
}


@pytest.mark.parametrize("shape", sorted(OVERSIZED_SHAPES))
async def test_oversized_frames_never_reach_recv_and_the_receiver_stays_healthy(
    endpoints: Endpoints, shape: str
) -> None:
    limits = Limits(max_frame_bytes=4096)
    receiver = endpoints.open(limits)
    offender, good = endpoints.open(limits), endpoints.open(limits)
    # The send itself may succeed: ZeroMQ drops the frame on the receiving side
    # (MAXMSGSIZE) and disconnects the offender; inproc refuses it at delivery.
    await offender.send(receiver.address, OVERSIZED_SHAPES[shape](), timeout=RECV_TIMEOUT)
    await good.send(receiver.address, [b"good"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"good"]
    await assert_quiet(receiver)
    if endpoints.scheme == "inproc":
        assert receiver.dropped() == 1  # ZeroMQ drops these inside libzmq, uncounted

    # A disconnected offender reconnects by itself; once it behaves, it is heard again.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        await offender.send(receiver.address, [b"sorry"], timeout=RECV_TIMEOUT)
        try:
            assert await recv_within(receiver, timeout=0.3) == [b"sorry"]
            break
        except TimeoutError:
            continue  # lost with the old connection; retry
    else:
        pytest.fail("the offender was never heard again after behaving")


async def test_too_many_frames_are_dropped_and_counted(endpoints: Endpoints) -> None:
    limits = Limits(max_frames=3)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    await sender.send(receiver.address, [b"f"] * 4, timeout=RECV_TIMEOUT)
    await sender.send(receiver.address, [b"a", b"b", b"c"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"a", b"b", b"c"]  # FIFO: the bad one came first
    assert receiver.dropped() == 1
    await assert_quiet(receiver)


async def test_full_inbox_pushes_back_without_losing_accepted_messages(endpoints: Endpoints) -> None:
    limits = Limits(inbox_size=4, send_hwm=2)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    payload = b"\x00" * (64 << 10)
    bound = 1000  # 64 MB: far above what the HWMs and kernel buffers can hold
    accepted = 0
    with pytest.raises(TransportError):
        while accepted < bound:
            await sender.send(receiver.address, sequenced(accepted, payload), timeout=0.3)
            accepted += 1
    assert limits.inbox_size <= accepted < bound
    # Everything that was accepted arrives, in order, once the receiver reads.
    for n in range(accepted):
        header, body = await recv_within(receiver)
        assert struct.unpack("!Q", header)[0] == n and len(body) == len(payload)
    await assert_quiet(receiver)
    await sender.send(receiver.address, [b"room again"], timeout=RECV_TIMEOUT)
    assert await recv_within(receiver) == [b"room again"]


# --- failures are bounded and typed -----------------------------------------------------------


async def test_send_to_nobody_raises_within_the_timeout(endpoints: Endpoints) -> None:
    sender = endpoints.open()
    started = time.monotonic()
    with pytest.raises(TransportError):
        await sender.send(endpoints.unused_address(), [b"anyone?"], timeout=0.3)
    assert time.monotonic() - started < 0.3 + 1.0


async def test_close_is_idempotent_and_a_closed_transport_refuses_to_send(endpoints: Endpoints) -> None:
    receiver, sender = endpoints.open(), endpoints.open()
    await sender.close()
    await sender.close()
    with pytest.raises(TransportClosed):
        await sender.send(receiver.address, [b"x"], timeout=RECV_TIMEOUT)
    with pytest.raises(TransportClosed):
        await sender.send(sender.address, [b"x"], timeout=RECV_TIMEOUT)


async def test_close_with_linger_still_delivers_what_was_sent(endpoints: Endpoints) -> None:
    """A process's last messages (a seat's Finished, the coordinator's Stop) are sent just before it closes."""
    receiver, sender = endpoints.open(), endpoints.open()
    for n in range(20):
        await sender.send(receiver.address, sequenced(n, b"x" * 1000), timeout=RECV_TIMEOUT)
    await sender.close(linger=RECV_TIMEOUT)
    for n in range(20):
        assert await recv_within(receiver) == [struct.pack("!Q", n), b"x" * 1000]


@pytest.mark.parametrize("was_connected", [False, True], ids=["never-connected", "connected"])
async def test_sending_to_a_peer_that_closed_fails_within_bounded_time(
    endpoints: Endpoints, was_connected: bool
) -> None:
    """A peer that left makes sends fail, each within its timeout; none hangs.

    ZeroMQ closes sockets asynchronously, so a send racing the peer's close may
    still be accepted and then lost with the connection: a returned send() is
    never proof of delivery (acks are).  Once the close has settled, sends fail.
    """
    receiver, sender = endpoints.open(), endpoints.open()
    if was_connected:
        await sender.send(receiver.address, [b"hello"], timeout=RECV_TIMEOUT)
        assert await recv_within(receiver) == [b"hello"]
    address = receiver.address
    await receiver.close()
    for _attempt in range(10):
        started = time.monotonic()
        try:
            await sender.send(address, [b"x"], timeout=0.3)
        except TransportError:
            break
        finally:
            assert time.monotonic() - started < 0.3 + 1.0
        await asyncio.sleep(0.05)
    else:
        pytest.fail("sends to a closed peer kept being accepted")


async def test_run_returns_after_close(endpoints: Endpoints) -> None:
    transport = endpoints.open(run=False)
    reader = endpoints.start(transport)
    await asyncio.sleep(0.05)  # let the reader block on the socket
    await transport.close()
    await asyncio.wait_for(reader, RECV_TIMEOUT)  # returns: neither hangs nor ends cancelled


async def test_run_returns_after_close_even_with_a_full_inbox(endpoints: Endpoints) -> None:
    """A reader blocked on a full inbox must still notice close()."""
    limits = Limits(inbox_size=2, send_hwm=1)
    receiver, sender = endpoints.open(limits, run=False), endpoints.open(limits)
    reader = endpoints.start(receiver)
    with pytest.raises(TransportError):
        for _ in range(1000):
            await sender.send(receiver.address, [b"\x00" * (64 << 10)], timeout=0.3)
    await receiver.close()
    await asyncio.wait_for(reader, RECV_TIMEOUT)


async def test_a_pending_send_fails_with_transport_error_when_its_transport_closes(endpoints: Endpoints) -> None:
    limits = Limits(inbox_size=1, send_hwm=1)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    with pytest.raises(TransportError):  # fill every queue up to the sender
        for _ in range(1000):
            await sender.send(receiver.address, [b"\x00" * (64 << 10)], timeout=0.3)
    pending = asyncio.create_task(sender.send(receiver.address, [b"blocked"], timeout=1.0))
    await asyncio.sleep(0.05)
    await sender.close()
    with pytest.raises(TransportError):
        await asyncio.wait_for(pending, 1.0 + RECV_TIMEOUT)


async def test_an_address_can_be_bound_again_after_close(endpoints: Endpoints) -> None:
    """A closed address is free again soon, bounded (ZeroMQ unbinds in its I/O thread,
    so an immediate rebind may briefly find it still in use; a failed bind leaks nothing)."""
    first = endpoints.open()
    address = first.address
    await first.close()
    deadline = time.monotonic() + RECV_TIMEOUT
    while True:
        try:
            again = endpoints.open(url=address)
            break
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)
    sender = endpoints.open()
    await sender.send(again.address, [b"back"], timeout=RECV_TIMEOUT)
    assert await recv_within(again) == [b"back"]


async def test_binding_a_bound_address_fails_cleanly(endpoints: Endpoints) -> None:
    taken = endpoints.open()
    with pytest.raises((zmq.ZMQError, ValueError)):  # inproc raises ValueError, ZeroMQ ZMQError
        endpoints.open(url=taken.address)
    # teardown checks that the failed bind left no socket open


async def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown transport URL"):
        open_transport("udp://127.0.0.1:9")


async def test_zmq_send_accepted_at_once_arms_no_timer_and_a_pending_one_keeps_its_bound(
    endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path: a send pyzmq queued immediately returns without asyncio.wait_for (no task, no timer);
    a send that has to wait still goes through it and still fails within its timeout."""
    if endpoints.scheme == "inproc":
        pytest.skip("the fast path is ZeroMQ's")
    waits: list[float] = []
    real_wait_for = asyncio.wait_for

    async def counting_wait_for(awaitable: Any, timeout: float) -> Any:
        waits.append(timeout)
        return await real_wait_for(awaitable, timeout)

    monkeypatch.setattr(zmq_transport.asyncio, "wait_for", counting_wait_for)
    receiver, sender = endpoints.open(), endpoints.open()
    await sender.send(receiver.address, [b"warm"], timeout=RECV_TIMEOUT)  # may wait for the connection
    assert await recv_within(receiver) == [b"warm"]
    waits.clear()
    for n in range(20):
        await sender.send(receiver.address, [struct.pack("!Q", n)], timeout=RECV_TIMEOUT)
    assert waits == [], "immediately accepted sends must not arm a timeout"
    assert [struct.unpack("!Q", (await recv_within(receiver))[0])[0] for _ in range(20)] == list(range(20))
    waits.clear()
    started = time.monotonic()
    with pytest.raises(TransportError, match="not accepted within"):
        await sender.send(endpoints.unused_address(), [b"anyone?"], timeout=0.3)
    assert waits == [0.3] and time.monotonic() - started < 0.3 + 1.0


async def test_a_send_while_the_process_exits_is_transport_closed_not_a_crash(
    endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyzmq's zero-copy frames need its garbage-collector thread, shut down at interpreter exit;
    a runtime thread still resending a snapshot then must see TransportClosed (its loops end quietly)."""
    if endpoints.scheme == "inproc":
        pytest.skip("pyzmq's gc thread is ZeroMQ's")
    receiver, sender = endpoints.open(), endpoints.open()
    monkeypatch.setattr(zmq.utils.garbage.gc, "_stay_down", True, raising=False)  # what atexit sets
    with pytest.raises(TransportClosed, match="the process is exiting"):
        await sender.send(receiver.address, [bytes(4 * zmq.COPY_THRESHOLD)], timeout=RECV_TIMEOUT)


# --- the partition wrapper, cut -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["inproc", "tcp"])
async def test_a_cut_switch_drops_everything_both_ways_silently(ipc_dir: Path, kind: str) -> None:
    endpoints = Endpoints(kind, ipc_dir)
    try:
        switch = PartitionSwitch()
        inner_a, peer = endpoints.open(), endpoints.open()
        cut = PartitionedTransport(inner_a, switch)
        await cut.send(peer.address, [b"before"], timeout=RECV_TIMEOUT)
        assert await recv_within(peer) == [b"before"]
        await peer.send(cut.address, [b"to a, before"], timeout=RECV_TIMEOUT)
        assert await recv_within(cut) == [b"to a, before"]
        switch.cut = True
        await cut.send(peer.address, [b"lost"], timeout=RECV_TIMEOUT)  # no error: a cut link tells nobody
        await peer.send(cut.address, [b"to a, lost"], timeout=RECV_TIMEOUT)
        await assert_quiet(peer)
        await assert_quiet(cut)
        assert cut.address == inner_a.address and cut.dropped() == inner_a.dropped()
    finally:
        await endpoints.aclose()


async def test_try_send_queues_at_once_or_leaves_it_to_send_and_never_overtakes(endpoints: Endpoints) -> None:
    """The coordinator's usual send, without a task: queued at once where there is room; False (nothing queued)
    while the peer's queue is full or a send to it waits, so a message it queues never passes an earlier one."""
    limits = Limits(inbox_size=4, send_hwm=2)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    payload = b"\x00" * (64 << 10)
    deadline = time.monotonic() + RECV_TIMEOUT
    while not sender.try_send(receiver.address, sequenced(0, payload)):  # ZeroMQ: not connected at first
        assert time.monotonic() < deadline, "try_send never queued to an idle peer"
        await asyncio.sleep(0.01)
    sent = 1
    while sender.try_send(receiver.address, sequenced(sent, payload)):
        sent += 1
        assert sent < 2000, "the queue never filled"  # 128 MB: far more than the HWMs and kernel buffers hold
    waiting = [asyncio.create_task(sender.send(receiver.address, sequenced(n, payload), timeout=10.0))
               for n in range(sent, sent + 400)]  # 25 MB more: most of them wait
    await asyncio.sleep(0.2)
    assert not all(task.done() for task in waiting), "the queue never filled: nothing here waited"
    assert not sender.try_send(receiver.address, [b"early"]), "it would pass the sends that wait"
    got = [struct.unpack("!Q", (await recv_within(receiver))[0])[0] for _ in range(sent + 400)]
    await asyncio.gather(*waiting)
    assert got == list(range(sent + 400))
    assert sender.try_send(receiver.address, [b"room again"])
    assert await recv_within(receiver) == [b"room again"]
    await sender.close()
    assert not sender.try_send(receiver.address, [b"closed"]), "a closed transport queues nothing"
    await assert_quiet(receiver)


async def test_try_send_does_not_pass_a_send_that_room_has_just_woken(endpoints: Endpoints) -> None:
    """In process the moment is exact: the inbox has room again, but the send that waited for it has not run
    yet; a message try_send queued now would pass it."""
    if endpoints.scheme != "inproc":
        pytest.skip("ZeroMQ wakes a waiting send on its own schedule: the tcp/ipc case is the test above")
    limits = Limits(inbox_size=2)
    receiver, sender = endpoints.open(limits), endpoints.open(limits)
    assert sender.try_send(receiver.address, [b"0"]) and sender.try_send(receiver.address, [b"1"])
    assert not sender.try_send(receiver.address, [b"full"])
    waiting = asyncio.create_task(sender.send(receiver.address, [b"2"], timeout=RECV_TIMEOUT))
    await asyncio.sleep(0.01)
    assert [bytes(f) for f in await receiver.recv()] == [b"0"]  # a message waits: taken without a yield
    assert not sender.try_send(receiver.address, [b"3"]), "room for one, but the waiting send is woken, not run"
    await waiting
    assert await recv_within(receiver) == [b"1"]
    assert sender.try_send(receiver.address, [b"3"])
    assert [await recv_within(receiver) for _ in range(2)] == [[b"2"], [b"3"]]
