"""Partitioned transport: the fault injector behind ``partition:`` chaos specs.

It wraps any transport and, once its switch is cut, drops every message both
ways, silently, as a cut link would; the process and its other sockets live
on.  The runtime thread wraps its transports in it only when a ``partition:``
spec names this process, so a run without one pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from deadpool.protocol.transport import Frame, Transport


class PartitionSwitch:
    """Cut once by the compute thread (``chaos.inject``), read by the runtime thread (a GIL-atomic bool)."""

    cut = False


class PartitionedTransport:
    """Wraps a transport; once `switch` is cut, nothing is sent and everything received is dropped."""

    def __init__(self, inner: Transport, switch: PartitionSwitch) -> None:
        self._inner = inner
        self._switch = switch

    @property
    def address(self) -> str:
        return self._inner.address

    async def run(self) -> None:
        await self._inner.run()

    async def recv(self) -> list[memoryview]:
        while True:
            frames = await self._inner.recv()
            if not self._switch.cut:
                return frames

    def pending(self) -> int:
        return self._inner.pending()

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        if not self._switch.cut:
            await self._inner.send(address, frames, timeout)

    def try_send(self, address: str, frames: Sequence[Frame]) -> bool:
        return self._switch.cut or self._inner.try_send(address, frames)

    def forget(self, address: str) -> None:
        self._inner.forget(address)

    def dropped(self) -> int:
        return self._inner.dropped()

    async def close(self, linger: float = 0.0) -> None:
        await self._inner.close(linger)
