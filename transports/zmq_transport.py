"""ZeroMQ transport for real runs: PULL to receive, one PUSH per destination to send.

Why PUSH/PULL: every DeadPool message carries its sender's identity inside its
(authenticated) payload, so the socket layer needs no routing identities, and
PUSH's high-water mark gives back-pressure for free.  ``IMMEDIATE`` keeps
messages from piling up for peers that are not connected (a dead buddy costs
a send timeout, not memory), ``MAXMSGSIZE`` makes ZeroMQ drop (and
disconnect) a peer that sends an oversized frame before any byte reaches
Python, and ``LINGER=0`` lets a closing process exit at once
(``close(linger=S)`` keeps delivering what was already sent, for at most S
seconds, where that matters).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
import typing
from collections.abc import Sequence

import zmq
import zmq.asyncio

from deadpool.protocol.transport import Frame, Limits, TransportClosed, TransportError

_CONTEXT: zmq.asyncio.Context | None = None
_CONTEXT_PID = 0
_OPEN = 0  # transports open on _CONTEXT
_LOCK = threading.Lock()  # transports open and close on several threads (each runtime has its own loop)
DRAIN_BATCH = 256  # messages read without waiting after one that was waited for, before others run


def _max_sockets(limit: int) -> int:
    """Sockets a context may open: as many as the process may open descriptors (each needs at least one).

    libzmq's default is 1,023, and this transport opens one PUSH socket per peer it sends to: a
    coordinator of more than about a thousand members could not reach the rest (its sends failed
    with "Too many open files").  The descriptor limit is the real bound.
    """
    try:
        import resource  # POSIX only
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1023
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1023, min(limit, soft))


def _current_context() -> zmq.asyncio.Context:
    """The process's context; the caller holds _LOCK."""
    global _CONTEXT, _CONTEXT_PID, _OPEN
    if _CONTEXT is None or os.getpid() != _CONTEXT_PID:
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, _max_sockets(context.get(zmq.SOCKET_LIMIT)))  # before its first socket
        _CONTEXT = context
        _CONTEXT_PID = os.getpid()
        _OPEN = 0
    return _CONTEXT


def shared_context() -> zmq.asyncio.Context:
    """One ZeroMQ context per process (rebuilt after fork, and after the last transport closed)."""
    with _LOCK:
        return _current_context()


def _acquire_context() -> zmq.asyncio.Context:
    """The context for a new transport, counted at once (so that no close terminates it under us)."""
    global _OPEN
    with _LOCK:
        context = _current_context()
        _OPEN += 1
        return context


def _release_context(context: zmq.asyncio.Context) -> None:
    """When the process's last transport closes, terminate the context.

    ``term()`` returns once every socket closed with a linger has handed its
    queued messages to the operating system, or its linger passed: the one
    bounded wait for "what was sent has left".  Every socket is closed by then
    (a transport closes all of its own), so it cannot block on an open one.
    """
    global _CONTEXT, _OPEN
    with _LOCK:
        if context is not _CONTEXT or os.getpid() != _CONTEXT_PID:
            return  # a context of the parent process (fork) or one already terminated
        _OPEN -= 1
        if _OPEN > 0:
            return
        _CONTEXT = None
    context.term()


def _task_cancelled() -> bool:
    """Whether someone asked to cancel the running task (as opposed to pyzmq
    cancelling one of its futures because its socket was closed)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; on 3.10 close() wins
    return cancelling is not None and cancelling() > 0


def _refuse_live_ipc(url: str) -> None:
    """Refuse an ipc path that a live endpoint holds, as tcp refuses a port in use.

    libzmq's ipc bind unlinks an existing socket file and takes the path over, so a
    second endpoint would silently steal the address from a live one.  A stale file
    left by a dead process (nobody accepts on it) is still taken over, as before.

    Raises:
        zmq.ZMQError: EADDRINUSE, someone accepts connections on the path.
    """
    path = url[len("ipc://") :]
    if not path or path.startswith("@") or not os.path.exists(path):  # "@": abstract namespace
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # nobody listening: a stale file
    finally:
        probe.close()
    raise zmq.ZMQError(errno.EADDRINUSE, f"Address already in use (addr={url!r})")


class ZmqTransport:
    """A bound PULL socket plus lazily connected PUSH sockets, one per peer address."""

    def __init__(self, url: str, limits: Limits) -> None:
        self._limits = limits
        self._context = _acquire_context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, limits.inbox_size)
        self._pull.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        try:
            if url.startswith("tcp://") and url.endswith(":0"):
                port = self._pull.bind_to_random_port(url[: -len(":0")])
                self._address = f"{url[: -len(':0')]}:{port}"
            else:
                if url.startswith("ipc://"):
                    _refuse_live_ipc(url)
                self._pull.bind(url)
                self._address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._pull.close(linger=0)  # a failed bind must not leak the socket (and block Context.term)
            _release_context(self._context)
            raise
        # What is already queued is read through a plain (blocking-API) handle on the same socket, without
        # waiting: an asyncio receive costs a future and its callbacks per message, several times what the
        # read itself does, and a coordinator reads every member's heartbeats and answers.
        self._pull_direct: zmq.Socket[bytes] = zmq.Socket.shadow(self._pull.underlying)
        # Per peer: its PUSH socket, with a plain handle on it (a send that need not wait costs no future), and
        # how many sends to it wait for room (while any does, later ones queue behind it: the order stays the
        # order sent).
        self._pushes: dict[str, tuple[zmq.asyncio.Socket, zmq.Socket[bytes]]] = {}
        self._waiting: dict[str, int] = {}
        self._inbox: asyncio.Queue[list[memoryview]] = asyncio.Queue(maxsize=limits.inbox_size)
        self._dropped = 0
        self._closed = False
        self._closed_event = asyncio.Event()  # wakes a reader blocked on a full inbox

    @property
    def address(self) -> str:
        return self._address

    async def run(self) -> None:
        while not self._closed:
            try:
                parts: list[zmq.Frame] | None = await self._pull.recv_multipart(copy=False)
            except asyncio.CancelledError:
                # close() makes pyzmq cancel the pending receive: that is our
                # normal end, not a cancellation of the task that awaits run().
                if self._closed and not _task_cancelled():
                    return
                raise
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            taken = 0
            while parts is not None:  # this message, then up to DRAIN_BATCH - 1 already queued ones
                if not await self._accept(parts) or self._closed:  # the plain handle must not outlive the socket
                    return
                taken += 1
                parts = self._queued() if taken < DRAIN_BATCH else None
            await asyncio.sleep(0)  # a long backlog does not keep the loop's other tasks waiting

    def _queued(self) -> list[zmq.Frame] | None:
        """The next message if one is queued already (read without waiting), else None."""
        try:
            return self._pull_direct.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    async def _accept(self, parts: list[zmq.Frame]) -> bool:
        """Queue a received message for recv() (waiting for room); False once the transport is closed."""
        if len(parts) > self._limits.max_frames:
            self._dropped += 1
            return True
        message = [part.buffer for part in parts]
        try:
            self._inbox.put_nowait(message)
        except asyncio.QueueFull:
            return await self._put_unless_closed(message)
        return True

    async def _put_unless_closed(self, message: list[memoryview]) -> bool:
        """Wait for room in the full inbox (back-pressure), but stop waiting at close().

        Without this, a reader blocked on a full inbox would never see close()
        and run() would not return.  Returns whether the message was queued.
        """
        put = asyncio.ensure_future(self._inbox.put(message))
        closed = asyncio.ensure_future(self._closed_event.wait())
        try:
            await asyncio.wait((put, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            put.cancel()
            closed.cancel()
            await asyncio.gather(put, closed, return_exceptions=True)
        return not put.cancelled()

    async def recv(self) -> list[memoryview]:
        return await self._inbox.get()

    def pending(self) -> int:
        return self._inbox.qsize()

    def _push_for(self, address: str) -> tuple[zmq.asyncio.Socket, zmq.Socket[bytes]]:
        push = self._pushes.get(address)
        if push is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._limits.send_hwm)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close(linger=0)  # a leaked socket would block Context.term()
                raise
            push = self._pushes[address] = (sock, zmq.Socket.shadow(sock.underlying))
        return push

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        if self._closed:
            raise TransportClosed("transport is closed")
        if self.try_send(address, frames):
            return  # queued at once, the usual case
        # A full queue, the peer not connected yet, or a send of ours to it waiting: wait for room, bounded (an
        # error try_send met comes again here, raised).
        try:
            sock, _ = self._push_for(address)
        except zmq.ZMQError as err:
            raise TransportError(f"cannot connect to {address!r}: {err}") from None
        try:
            self._waiting[address] = self._waiting.get(address, 0) + 1
            try:
                # zmq.asyncio returns an asyncio Future (typed only as an Awaitable).
                sent = typing.cast("asyncio.Future[object]", sock.send_multipart(list(frames), copy=False))
                if sent.done():  # room came meanwhile: no timer for a wait that cannot happen
                    sent.result()
                else:
                    await asyncio.wait_for(sent, timeout)
            finally:
                if self._waiting[address] > 1:
                    self._waiting[address] -= 1
                else:
                    del self._waiting[address]  # only peers with a send waiting keep an entry
        except TimeoutError:
            raise TransportError(f"send to {address} not accepted within {timeout:.2f}s") from None
        except asyncio.CancelledError:
            # close() or forget() closed the socket, and pyzmq cancelled our pending send.
            if sock.closed and not _task_cancelled():
                if self._closed:  # close(), not forget(): nothing more will be sent
                    raise TransportClosed(f"send to {address} abandoned: the transport was closed") from None
                raise TransportError(f"send to {address} abandoned: the socket was closed") from None
            raise
        except zmq.ZMQError as err:
            if self._closed:
                raise TransportClosed(f"send to {address} abandoned: the transport was closed") from err
            raise TransportError(f"send to {address} failed: {err}") from err
        except RuntimeError as err:  # pyzmq's zero-copy frames need its gc thread, gone once the process exits
            raise TransportClosed(f"send to {address} abandoned: the process is exiting ({err})") from err

    def try_send(self, address: str, frames: Sequence[Frame]) -> bool:
        if self._closed or self._waiting.get(address):
            return False
        try:
            self._push_for(address)[1].send_multipart(list(frames), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # Again (no room, or not connected yet), or worse: send() waits, or raises it
            return False
        except RuntimeError:  # pyzmq's zero-copy frames at process exit: send() says so
            return False
        return True

    def forget(self, address: str) -> None:
        """Close the PUSH socket to a peer that left, dropping what was queued for it."""
        push = self._pushes.pop(address, None)
        if push is not None:
            push[0].close(linger=0)

    def dropped(self) -> int:
        return self._dropped

    async def close(self, linger: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        self._pull.close(linger=0)
        for sock, _ in self._pushes.values():
            sock.close(linger=max(0, int(linger * 1000)))
        self._pushes.clear()
        _release_context(self._context)
