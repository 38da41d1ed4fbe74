"""In-process transport: asyncio queues addressed by ``inproc://name``.

For protocol tests and large simulated clusters: no sockets, no threads, fully
deterministic under one event loop.  It enforces the same limits as the
ZeroMQ transport (frame size, frame count, bounded inboxes, send timeouts) and
copies every frame, as a wire would.  A partition can be injected by
blocking addresses: messages to or from them are dropped silently, as a cut
link would.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from deadpool.protocol.transport import Frame, Limits, TransportClosed, TransportError

_ENDPOINTS: dict[str, InProcTransport] = {}
_BLOCKED: set[str] = set()
_AUTONAME = itertools.count()


def partition(address: str, cut: bool = True) -> None:
    """Drop (cut=True) or restore (cut=False) all traffic to and from `address`."""
    if cut:
        _BLOCKED.add(address)
    else:
        _BLOCKED.discard(address)


class InProcTransport:
    """One endpoint in the process-wide registry."""

    def __init__(self, url: str, limits: Limits) -> None:
        if url in ("inproc://", "inproc://*"):
            url = f"inproc://auto-{next(_AUTONAME)}"
        if url in _ENDPOINTS:
            raise ValueError(f"{url} is already bound in this process")
        self._address = url
        self._limits = limits
        self._inbox: asyncio.Queue[list[memoryview]] = asyncio.Queue(maxsize=limits.inbox_size)
        # Senders waiting for room get it in the order they came: a send made just as room appears does not
        # pass one already waiting (asyncio.Lock hands itself to its oldest waiter), as ZeroMQ's queue keeps order.
        self._room = asyncio.Lock()
        self._waiting = 0  # senders in _deliver: try_send does not pass them
        self._dropped = 0
        self._closed = asyncio.Event()
        _ENDPOINTS[url] = self

    @property
    def address(self) -> str:
        return self._address

    async def run(self) -> None:
        await self._closed.wait()

    async def recv(self) -> list[memoryview]:
        return await self._inbox.get()

    def pending(self) -> int:
        return self._inbox.qsize()

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")
        if address in _BLOCKED or self._address in _BLOCKED:
            return  # a cut link loses messages without telling anyone
        target = _ENDPOINTS.get(address)
        if target is None:
            raise TransportError(f"no endpoint bound at {address}")
        await target._deliver(frames, timeout)

    def try_send(self, address: str, frames: Sequence[Frame]) -> bool:
        if self._closed.is_set():
            return False
        if address in _BLOCKED or self._address in _BLOCKED:
            return True  # lost, as send() loses it
        target = _ENDPOINTS.get(address)
        if target is None or target._waiting or target._inbox.full():
            return False
        copied = target._admit(frames)
        if copied is not None:
            target._inbox.put_nowait(copied)
        return True

    def _admit(self, frames: Sequence[Frame]) -> list[memoryview] | None:
        """The frames copied, as a wire would, or None (dropped and counted) where the limits refuse them."""
        # nbytes, not len(): len() of a typed memoryview counts items, not bytes.
        sizes = (memoryview(f).nbytes for f in frames)
        if len(frames) > self._limits.max_frames or any(size > self._limits.max_frame_bytes for size in sizes):
            self._dropped += 1
            return None
        return [memoryview(bytes(frame)) for frame in frames]

    async def _deliver(self, frames: Sequence[Frame], timeout: float) -> None:
        copied = self._admit(frames)
        if copied is None:
            return
        self._waiting += 1
        try:
            await asyncio.wait_for(self._put(copied), timeout)
        except TimeoutError:
            raise TransportError(f"{self._address} did not accept within {timeout:.2f}s") from None
        finally:
            self._waiting -= 1

    async def _put(self, message: list[memoryview]) -> None:
        async with self._room:
            await self._inbox.put(message)

    def forget(self, address: str) -> None:
        """Nothing is cached per peer here."""

    def dropped(self) -> int:
        return self._dropped

    async def close(self, linger: float = 0.0) -> None:
        # `linger` needs nothing here: a sent message is already in the receiver's inbox.
        if self._closed.is_set():
            return
        self._closed.set()
        _ENDPOINTS.pop(self._address, None)
