"""The runtime thread: an asyncio loop (uvloop when installed) beside the compute thread.

It owns two transports (control: coordinator traffic; bulk: snapshot traffic,
kept apart so liveness never queues behind a 100 MB transfer), one reader
task per transport that decodes and routes frames, and three actors:
``HeartbeatActor``, ``MembershipActor`` and ``SnapshotActor``.  Every task
belongs to one ``asyncio.TaskGroup``; ``stop()`` is a message ordered after
what the compute thread posted before it, then closes the transports first
(so nothing stays blocked on I/O) and cancels and awaits the group.

The compute thread reaches it only through ``Handoff.post``, which lands in
``_route_from_compute`` on this loop: the router only routes, into the
actors' local inbox lanes, which peer traffic can never fill.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Awaitable, Callable

from deadpool.actors.handoff import Fetch, Handoff, LocalReady, PrepareReady, Progress
from deadpool.actors.heartbeat import HeartbeatActor
from deadpool.actors.inbox import Bulk, Drain, Inbound, Outbound, Shutdown
from deadpool.actors.membership import MembershipActor
from deadpool.actors.snapshot_actor import CHUNK_BYTES, SnapshotActor
from deadpool.actors.watch import ComputeWatch
from deadpool.chaos import Switch
from deadpool.config import Config, is_loopback
from deadpool.errors import MisuseError
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import (
    Message,
    PeerPaused,
    RestoreReply,
    RestoreRequest,
    Role,
    SnapshotAck,
    SnapshotHeader,
    Stop,
)
from deadpool.protocol.transport import CONTROL_LIMITS, Limits, Transport, new_event_loop, open_transport

log = logging.getLogger("deadpool.worker.runtime")

_BULK_TYPES = (SnapshotHeader, SnapshotAck, RestoreRequest, RestoreReply, PeerPaused)
BULK_LIMITS = Limits(max_frame_bytes=CHUNK_BYTES + (1 << 20), max_frames=4097, inbox_size=8, send_hwm=8)
# The fault injector, an implementation beside the others (loaded by name like them: it is packaged as
# deadpool.transports from the top-level transports/ folder).
_PARTITIONED = "deadpool.transports.partitioned"


class RuntimeThread:
    """Starts, hosts and stops the worker's actors."""

    def __init__(
        self,
        member: str,
        coordinator: str,
        bind_host: str,
        config: Config,
        handoff: Handoff,
        progress: Progress,
        events: EventLog,
        transport_scheme: str = "tcp",
        partitionable: bool = False,
    ) -> None:
        self.member = member
        self._coordinator = coordinator
        self._bind_host = bind_host
        self._config = config
        self._secret = config.secret.encode() or None
        self._handoff = handoff
        self._progress = progress
        self._events = events
        self._scheme = transport_scheme
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._startup_error: BaseException | None = None
        self._compute_thread = threading.get_ident()  # built by the compute thread (the watch reads its stack)
        self._stop_event: asyncio.Event | None = None
        self._bulk_linger = 0.0  # how long, once stopping, the snapshot parts already sent may take to leave
        self.control_addr = ""
        self.bulk_addr = ""
        self._membership: MembershipActor | None = None
        self._snapshots: SnapshotActor | None = None
        self._rejections: Counter[str] = Counter()
        self.partition: Switch = importlib.import_module(_PARTITIONED).PartitionSwitch()  # cut by ``chaos.inject``
        self._partitionable = partitionable  # such a spec names this process: wrap the transports in the switch
        self.role_and_host: tuple[Role, str] = (Role.ACTIVE, "")  # set by the runtime before start, for ViewReports
        self._thread = threading.Thread(target=self._main, name="deadpool-runtime", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        """Start the thread and wait until both transports are bound.

        Raises:
            RuntimeError: the loop failed to start (the original error is chained).
        """
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"runtime thread did not start within {timeout:.0f}s")
        if self._startup_error is not None:
            raise RuntimeError("runtime thread failed to start") from self._startup_error

    def _main(self) -> None:
        loop = new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run())
        except BaseException as err:
            if not self._ready.is_set():
                self._startup_error = err
                self._ready.set()
            else:
                # Latched for the compute thread, which raises it at its next wait or step boundary:
                # this member then exits, and the job swaps it out like any failed member.
                log.exception("runtime thread ended with an error")
                self._handoff.deliver(Stop(False, f"this member's runtime thread failed ({err!r}); "
                                              "see the traceback above. The member exits and is replaced."))
        finally:
            self._handoff.bind(None)  # later posts fail at once instead of waiting for a loop that is gone
            loop.close()
            self._stopped.set()

    async def _run(self) -> None:
        host = self._bind_host
        if not is_loopback(host) and not self._secret:
            raise MisuseError(f"refusing to listen on {host} (not loopback) without a shared secret: "
                              "set DEADPOOL_SECRET to the same value on every host")
        control_url = f"{self._scheme}://{host}:0" if self._scheme == "tcp" else f"{self._scheme}://"
        control = self._open(control_url, CONTROL_LIMITS)
        bulk = self._open(control_url, BULK_LIMITS)
        self.control_addr, self.bulk_addr = control.address, bulk.address
        self._stop_event = asyncio.Event()
        config = self._config
        link = CoordinatorLink(self._coordinator)  # shared: a newer term moves both actors to its coordinator
        heartbeat = HeartbeatActor(
            self.member, link, control, self._progress, config.heartbeat_interval, self._secret,
            control.address, os.environ.get("DEADPOOL_AGENT", ""), int(os.environ.get("DEADPOOL_AGENT_PID", "0")),
        )  # the host agent `deadpool launch` that started this worker relays its beats (agent/relay.py)
        snapshots = SnapshotActor(
            self.member, bulk, self._handoff, self._progress, self._events, self._secret,
            send_timeout=max(30.0, config.send_timeout), shm_dir=config.shm_dir, to_membership=self._to_membership,
            depth=config.snapshot_depth, on_checked=heartbeat.nudge,
        )
        membership = MembershipActor(
            self.member, link, control, self._handoff, self._events, snapshots.inbox.post,
            self._secret, config.send_timeout, heartbeat.joined, heartbeat.reconnected,
            (*self.role_and_host, os.getpid(), control.address, bulk.address), heartbeat.via_agent,
        )
        self._membership, self._snapshots = membership, snapshots
        loop = asyncio.get_running_loop()

        def post(message: object) -> None:
            loop.call_soon_threadsafe(self._route_from_compute, message)

        self._handoff.bind(post)
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(control.run())
                tasks.create_task(bulk.run())
                tasks.create_task(self._read(control, self._on_control))
                tasks.create_task(self._read(bulk, self._on_bulk))
                tasks.create_task(heartbeat.run())
                tasks.create_task(membership.run())
                tasks.create_task(snapshots.run())
                tasks.create_task(ComputeWatch(self._handoff, self._events, self._compute_thread,
                                               config.pg_timeout).run())
                await self._stop_event.wait()
                if self._bulk_linger:
                    await snapshots.replies_sent(self._bulk_linger)
                # What the membership actor handed over (a seat's Finished) still reaches the coordinator.
                await control.close(linger=config.send_timeout)
                await bulk.close(linger=self._bulk_linger)
                raise _Stopping
        except* _Stopping:
            pass

    def _open(self, url: str, limits: Limits) -> Transport:
        """A bound transport, behind the partition switch only when a spec may cut it (no hops otherwise)."""
        transport = open_transport(url, limits)
        if not self._partitionable:
            return transport
        wrapped: Transport = importlib.import_module(_PARTITIONED).PartitionedTransport(transport, self.partition)
        return wrapped

    # -- routing ------------------------------------------------------------------------------

    async def _read(self, transport: Transport, handle: Callable[[Message, list[memoryview]], Awaitable[None]]) -> None:
        """One reader per transport: decode the first frame, route the message."""
        limit = CONTROL_LIMITS.max_frame_bytes
        while True:
            frames = await transport.recv()
            decoded = codec.decode(frames[0], self._secret, limit)
            if isinstance(decoded, codec.DecodeError):
                self._reject(decoded.reason, str(decoded))
                continue
            await handle(decoded, frames[1:])

    async def _on_control(self, message: Message, extra: list[memoryview]) -> None:
        assert self._membership is not None
        if extra:
            self._reject("unexpected_frames", f"{type(message).__name__} with payload on the control channel")
            return
        await self._membership.inbox.put(Inbound(message))

    async def _on_bulk(self, message: Message, frames: list[memoryview]) -> None:
        assert self._snapshots is not None
        if not isinstance(message, _BULK_TYPES):
            self._reject("unexpected_type", f"{type(message).__name__} on the bulk channel")
            return
        await self._snapshots.inbox.put(Bulk(message, frames))

    def _reject(self, reason: str, detail: str) -> None:
        """Log a refused frame as an event: every one of the first 20 per reason, then every 100th."""
        self._rejections[reason] += 1
        count = self._rejections[reason]
        if count <= 20 or count % 100 == 0:
            self._events.emit(schema.Rejected(reason=reason, detail=detail, count=count))

    def _route_from_compute(self, message: object) -> None:
        """Route what the compute thread posted to the actor that takes it (never refused, never blocks).

        Drain markers, and stopping (one more), pass the SnapshotActor on their way to the MembershipActor,
        so they follow the PrepareAcks that the SnapshotActor completes for PrepareReady posted before them.
        """
        assert self._membership is not None and self._snapshots is not None and self._stop_event is not None
        if isinstance(message, Shutdown):
            self._bulk_linger = message.linger_s
            self._snapshots.inbox.post(Drain(self._stop_event.set))
        elif isinstance(message, (LocalReady, Fetch, PrepareReady, Drain)):
            self._snapshots.inbox.post(message)
        elif isinstance(message, Message):
            self._membership.inbox.post(Outbound(message))
        else:
            log.error("the compute thread posted a %s, which no actor takes; dropped", type(message).__name__)

    def _to_membership(self, item: Outbound | Drain) -> None:
        """The SnapshotActor's way to the MembershipActor (its PrepareAcks, the drain markers it passes on)."""
        assert self._membership is not None
        self._membership.inbox.post(item)

    # -- lifecycle ----------------------------------------------------------------------------

    def snapshot_stats(self) -> tuple[int, int, int]:
        """(bytes streamed to the buddy, bytes held for wards, bytes of ward slots mapped), for the memory report:
        what the SnapshotActor published in ``Progress``."""
        p = self._progress
        return p.bytes_sent, p.bytes_held_for_wards, p.bytes_shared_for_wards

    def stop(self, timeout: float = 5.0, linger: bool = False) -> None:
        """Stop the loop (idempotent), waiting at most `timeout` seconds; `linger`: until the snapshot parts already
        sent to peers have left too (within the same bound)."""
        if self._loop is not None and not self._stopped.is_set():
            try:
                self._handoff.post(Shutdown(timeout if linger else 0.0))
            except RuntimeError:
                pass
        self._stopped.wait(timeout)


class _Stopping(Exception):
    """Raised inside the TaskGroup to cancel every actor on shutdown."""
