"""The coordinator process: sockets, the TCPStore and the serve loop around the state machine.

``python -m deadpool.coordinator.main`` (what ``deadpool launch`` and ``deadpool
coordinator`` start).  It binds the control transport and the store's socket,
prints the addresses, then feeds every received message and a periodic tick to
:class:`~deadpool.coordinator.service.Coordinator` and sends what it returns.
Torch is imported only inside :func:`_start_store`, after the addresses are out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from deadpool.config import Config, FreezeOnCommit, raise_priority, relax_gc
from deadpool.coordinator import fanout
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.coordinator.standby import Standby
from deadpool.coordinator.terms import Terms
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.link import EXIT_CODES, StandDown
from deadpool.protocol.messages import Message, Relay
from deadpool.protocol.transport import (
    CONTROL_LIMITS,
    Transport,
    TransportError,
    address_host,
    new_event_loop,
    open_transport,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from deadpool.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("deadpool.coordinator.main")


class Served(Protocol):
    """What the serve loop drives: the active coordinator, or a standby until it takes over."""

    events: EventLog

    @property
    def outcome(self) -> tuple[bool, str] | None: ...

    def handle(self, now: float, message: Message) -> list[Send]: ...

    def tick(self, now: float) -> list[Send]: ...


async def serve(coordinator: Served, transport: Transport, config: Config,
                first: Sequence[Send] = (), drain: bool = True) -> tuple[bool, str]:
    """Feed `coordinator` messages and time until its outcome, sending (`first` first) what it returns.

    A send never blocks the loop: it is queued at once or handed to a task bounded by ``send_timeout``
    (:class:`Dispatch`), so a dead peer costs a timed-out task, not a stall.
    """
    secret = config.secret.encode() or None
    # Silence is judged to a tenth of failure_timeout (0.2 s by default): the periodic checks are about
    # timeouts of seconds, and everything else here is driven by messages, not by this tick.
    interval = min(config.heartbeat_interval, config.failure_timeout / 10)
    recent = codec.Recent(secret, CONTROL_LIMITS.max_frame_bytes)  # an agent's unchanged heartbeat: decoded once
    frozen = FreezeOnCommit()
    async with asyncio.TaskGroup() as senders:
        dispatch = Dispatch(transport, secret, config.send_timeout, senders)
        dispatch(first)
        while coordinator.outcome is None:
            try:
                frames: list[memoryview] | None = await asyncio.wait_for(transport.recv(), interval)
            except TimeoutError:
                frames = None
            while frames is not None:
                message = _decode(frames, recent, coordinator.events)
                if message is not None:
                    dispatch(coordinator.handle(time.monotonic(), message))
                # Drain what is queued before judging silence: a heartbeat waiting in our own
                # inbox is not a missed heartbeat.
                frames = await transport.recv() if transport.pending() else None
            dispatch(coordinator.tick(time.monotonic()))
            frozen.committed(coordinator.events.epoch)  # the epoch its events carry: the view it holds
        if not drain:  # a standby taking over: its greetings to a lost active must not hold up the new term
            for task in dispatch.pending:
                task.cancel()
    # Every send was handed to the transport when the group above closed; the last ones (Stop) leave
    # when the process closes its transport with a linger (see _amain).
    assert coordinator.outcome is not None
    return coordinator.outcome


class Dispatch:
    """Hands the coordinator's sends to the transport, each encoded once per message object (``fanout.encoded``).

    A send goes at once where the peer's queue has room (``Transport.try_send``); else it becomes a task of
    `senders` that waits for room, bounded by `timeout`, and the peer's later sends follow in tasks until it is
    done, so each peer gets its messages in the order they were sent. At 131,072 members the coordinator sends
    tens of thousands a second: a task each costs more than the send itself.
    """

    def __init__(self, transport: Transport, secret: bytes | None, timeout: float,
                 senders: asyncio.TaskGroup) -> None:
        self._transport, self._secret, self._timeout, self._senders = transport, secret, timeout, senders
        self._headers: dict[str, tuple[Relay, bytes]] = {}  # each agent's last Relay header, encoded
        self._kept: dict[str, tuple[Message, bytes]] = {}  # each agent's last Welcome, encoded (Send.again)
        self._queued: dict[str, int] = {}  # peer -> its sends waiting in tasks
        self.pending: set[asyncio.Task[None]] = set()

    def __call__(self, sends: Sequence[Send]) -> None:
        if not sends:  # most messages change state and answer nothing
            return
        queued, try_send = self._queued, self._transport.try_send
        for send, frames in fanout.encoded(sends, self._secret, self._headers, self._kept):  # a broadcast: once
            address = send.address
            if address not in queued and try_send(address, frames):
                continue
            queued[address] = queued.get(address, 0) + 1
            task = self._senders.create_task(_deliver(self._transport, send, frames, self._timeout))
            self.pending.add(task)
            task.add_done_callback(functools.partial(self._sent, address))

    def _sent(self, address: str, task: asyncio.Task[None]) -> None:
        self.pending.discard(task)
        if self._queued[address] > 1:
            self._queued[address] -= 1
        else:
            del self._queued[address]


def _decode(frames: list[memoryview], recent: codec.Recent, events: EventLog) -> Message | None:
    """The message in `frames`, or None (logged as rejected) when it does not decode."""
    decoded = recent.decode(frames[0])
    if isinstance(decoded, codec.DecodeError):
        events.emit(schema.Rejected(reason=decoded.reason, detail=decoded.detail))
        return None
    if len(frames) != 1:
        events.emit(schema.Rejected(reason="unexpected_frames", detail=type(decoded).__name__))
        return None
    return decoded


async def _deliver(transport: Transport, send: Send, frames: list[bytes], timeout: float) -> None:
    try:
        await transport.send(send.address, frames, timeout)
    except TransportError as err:
        log.info("could not send %s to %s: %s", type(send.message).__name__, send.address, err)


def _listen(host: str, port: int) -> socket.socket:
    """The store's listening socket, bound before torch is imported (see ``_start_store``).

    Raises:
        OSError: the address cannot be bound (the port is in use, the host is not this machine's).
    """
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=1024)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, backlog=1024, dualstack_ipv6=True)
    return socket.create_server(("", port), backlog=1024)


def _start_store(host: str, listener: socket.socket) -> TCPStore:
    """Serve the TCPStore on a socket that already listens.

    Workers start when the coordinator has printed its addresses; importing torch
    for the store (about a CPU-second) happens after that, beside their own imports,
    instead of before them.  A client that connects meanwhile waits in the listen
    backlog; none does before the first view, which needs the store served.  The
    socket is bound to the coordinator's address, not every interface (a TCPStore
    binds the wildcard address when it binds itself).
    """
    from torch._C._distributed_c10d import TCPStore

    port = listener.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300),
                    master_listen_fd=listener.detach(), use_libuv=True)


async def _amain(args: argparse.Namespace) -> int:
    config = Config.from_env()
    host = address_host(args.bind) if "://" in args.bind else "127.0.0.1"
    if args.bind.startswith("tcp://") and host not in ("127.0.0.1", "localhost", "::1") and not config.secret:
        print("deadpool coordinator: refusing to bind a non-loopback address without a shared secret; "
              "set DEADPOOL_SECRET (the same value on every host) and retry.", file=sys.stderr)
        return 2
    exporter = _start_metrics(args)
    if isinstance(exporter, str):
        print(f"deadpool coordinator: {exporter}", file=sys.stderr)
        return 2
    store_bind = host if host != "0.0.0.0" else ""
    try:
        listener = _listen(store_bind, args.store_port)
    except OSError as err:
        print(f"deadpool coordinator: cannot listen for the TCPStore on {store_bind or '*'}:{args.store_port} "
              f"({err}); free the port or choose another (--master-port) and retry.", file=sys.stderr)
        return 2
    store_host = args.advertise or (host if host not in ("0.0.0.0", "") else socket.gethostname())
    store_addr = f"{store_host}:{listener.getsockname()[1]}"
    transport = open_transport(args.bind, CONTROL_LIMITS)
    events = EventLog(args.events or None, member="coordinator", source="coordinator")
    address = transport.address
    metrics_url = ""
    if exporter is not None:
        events.listeners.append(exporter.on_event)
        metrics_url = exporter.url
    if args.standby_of:
        events.emit(schema.StandbyStarted(address=address, store=store_addr, pid=os.getpid(),
                    active=args.standby_of, hosts=args.hosts))
    else:
        events.emit(schema.CoordinatorStarted(address=address, store=store_addr, pid=os.getpid(),
                    recovering=args.recover, world_size=args.world_size, metrics=metrics_url, term=1))
    print(json.dumps({"control": address, "store": store_addr, "metrics": metrics_url}), flush=True)
    # Members' first messages wait in the bound control socket until serve() reads them.
    store = _start_store(store_bind, listener)
    try:
        async with asyncio.TaskGroup() as tasks:
            reader = tasks.create_task(transport.run())
            code = await _coordinate(args, config, address, store_addr, events, transport, exporter)
            await transport.close(linger=config.send_timeout)  # returns once the Stops have left
            reader.cancel()
    finally:
        events.close()
        if exporter is not None:
            exporter.stop()
    del store
    return code


async def _coordinate(args: argparse.Namespace, config: Config, address: str, store_addr: str, events: EventLog,
                      transport: Transport, exporter: CoordinatorMetrics | None) -> int:
    """Stand by (``--standby-of``) until a takeover, then, or at once, coordinate; returns the exit status."""
    first: list[Send] = []
    if args.standby_of:
        standby = Standby(config, address, store_addr, args.standby_of, args.hosts, events, time.monotonic())
        await serve(standby, transport, config, drain=False)
        if not standby.took_over:
            return EXIT_CODES[StandDown.SUPERSEDED]  # the job ended under the active coordinator
        coordinator, first = standby.hand_over(config, args.world_size, time.monotonic())
        print(f"deadpool coordinator: took over as the coordinator of term {coordinator.terms.term} on {address}",
              file=sys.stderr, flush=True)
    else:
        coordinator = Coordinator(config, args.world_size, store_addr, events, started=time.monotonic(),
                                  recovering=args.recover,
                                  terms=Terms(1, address, store_addr, args.hosts, config.failure_timeout))
    refresher = asyncio.create_task(exporter.refresh_forever(
        lambda: coordinator.status(time.monotonic()))) if exporter else None
    try:
        ok, _ = await serve(coordinator, transport, config, first)
    finally:
        if refresher is not None:
            refresher.cancel()
    if coordinator.stood_down is not None:
        return EXIT_CODES[coordinator.stood_down]
    return 0 if ok else 1


def _start_metrics(args: argparse.Namespace) -> CoordinatorMetrics | str | None:
    """The Prometheus exporter serving when --metrics-port is given, None when not, or why it cannot serve."""
    if args.metrics_port < 0:
        return None
    try:
        from deadpool.coordinator.metrics import CoordinatorMetrics
    except ImportError as err:
        return f"--metrics-port needs prometheus-client ({err}); install it: pip install 'deadpool[metrics]'"
    exporter = CoordinatorMetrics()
    try:
        exporter.start(args.metrics_host, args.metrics_port)
    except OSError as err:
        return f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {err}"
    return exporter


def main(argv: list[str] | None = None) -> int:
    """``deadpool coordinator``: parse the arguments and serve until the job ends; returns the exit status."""
    parser = argparse.ArgumentParser(prog="deadpool coordinator", description="DeadPool's membership service")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="control address (port 0: pick a free one)")
    parser.add_argument("--world-size", type=int, required=True, help="number of seats in the job")
    parser.add_argument("--store-port", type=int, default=0, help="TCPStore port (0: pick a free one)")
    parser.add_argument("--advertise", default="", help="host name workers use to reach the store")
    parser.add_argument("--events", default="", help="append JSON-lines events to this file")
    parser.add_argument("--recover", action="store_true",
                        help="a restart: learn the view from the members instead of forming a first one")
    parser.add_argument("--standby-of", default="",
                        help="run as the standby of the active coordinator at this address: take over (a higher "
                             "term, this process's own store) when it is lost and most hosts confirm it")
    parser.add_argument("--hosts", type=int, default=0,
                        help="hosts in the job (a takeover, and a commit once there is a standby, need a majority)")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="serve Prometheus metrics on this port (0: pick a free one; default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    if args.standby_of and args.hosts < 3:
        parser.error("--standby-of needs --hosts of at least 3 (a takeover needs a majority of hosts to confirm "
                     "that the active coordinator is lost; with 2 hosts neither side can tell a cut from a loss)")
    logging.basicConfig(level=logging.WARNING, format="[coordinator] %(levelname)s %(message)s")
    raise_priority()
    relax_gc()
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_amain(args))
    except KeyboardInterrupt:  # Ctrl-C reaches the launcher's coordinator too: the launcher says what happens
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not cut the clean-up short
        return 128 + signal.SIGINT
    finally:
        loop.close()


if __name__ == "__main__":
    status = main()
    # Everything is closed (events file, sockets, the store); the interpreter's teardown of torch's
    # modules (0.5-1 s on a busy host) would only hold up the launcher, which waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
