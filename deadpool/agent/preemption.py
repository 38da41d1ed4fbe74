"""A preemption notice: SIGTERM to one host's launcher drains that host instead of losing it.

Kubernetes evicts a pod with SIGTERM and a grace period; a spot instance's notice or a maintenance drain
comes the same way. The launcher asks the coordinator to drain its host (a ``MoveCommand`` for its host,
its reason starting with "preemption"); the coordinator holds such requests for a short window, so that
SIGTERM reaching every host at once (the job being stopped) is told apart from one host's notice, and
refuses them all then. Once accepted, the host's seats move to spares on other hosts at their next step
boundary and its spares are released; every worker here exits 0 and so does the launcher. Refused, or
not done within ``--drain-timeout``, the launcher stops its workers as it would on any SIGTERM.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable

from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import MoveCommand, MoveResult
from deadpool.protocol.transport import Transport, TransportError

ANSWER_TIMEOUT = 10.0  # seconds for the coordinator's answer (it holds a notice for its window first)
REASON_PREFIX = "preemption"  # a MoveCommand reason starting with this is a launcher's notice


class Drain:
    """One host's answer to a preemption notice: ask, then wait for its workers to have left."""

    def __init__(self, host: str, secret: bytes, timeout: float) -> None:
        self._host = host
        self._secret = secret
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._nonce = secrets.randbits(62)
        self._answer: asyncio.Future[MoveResult] = asyncio.get_running_loop().create_future()

    def answered(self, result: MoveResult) -> bool:
        """The coordinator's answer (from the launcher's inbox); False when it is not this drain's."""
        if result.nonce != self._nonce or self._answer.done():
            return False
        self._answer.set_result(result)
        return True

    async def run(self, transport: Transport, link: CoordinatorLink, workers_left: Callable[[], int]) -> str:
        """Drain this host; returns "" once every worker here has exited, else why the host was not drained."""
        command = MoveCommand(-1, "", "", self._host, f"{REASON_PREFIX} notice (SIGTERM to the launcher of "
                              f"{self._host})", transport.address, self._nonce)
        try:
            await transport.send(link.active, [codec.encode(command, self._secret)], 2.0)
            result = await asyncio.wait_for(asyncio.shield(self._answer), min(ANSWER_TIMEOUT, self._left()))
        except TransportError as err:
            return f"the coordinator could not be asked to drain this host ({err})"
        except TimeoutError:
            return "the coordinator did not answer the drain request in time"
        if not result.ok:
            return f"the coordinator refused to drain this host: {result.detail}"
        while workers_left():
            if self._left() <= 0:
                return f"the drain did not finish within --drain-timeout {self._timeout:g} s"
            await asyncio.sleep(0.1)
        return ""

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())
