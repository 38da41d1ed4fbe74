"""Transport benchmark: how many control messages per second, how fast snapshots stream.

Two numbers bound what DeadPool can promise:

- **control rate**: heartbeats, views and acks are small msgpack messages; the
  coordinator handles every member's heartbeats on one event loop.  Measured
  as the full per-message path (``encode`` + ``Transport.send`` +
  ``Transport.recv`` + ``decode`` of a ``Heartbeat``), sender and receiver on
  one loop, for tcp, ipc and inproc, with and without HMAC.
- **inbound control**: what a coordinator does, several processes sending to
  one endpoint: four sender processes each send a burst of heartbeats; the
  receiver's CPU seconds per message received and decoded, over tcp, against
  a plain pyzmq receive loop on the same traffic (the floor).
- **snapshot streaming**: a seat streams its snapshot to its buddy as
  zero-copy frames (``copy=False``, as the transport sends them).  Measured
  from the first frame sent until the buddy, a separate process, acknowledges
  the whole snapshot (as ``SnapshotAck`` does), over tcp and ipc; once with the
  buddy only receiving, once also storing each frame into a preallocated arena
  (what a buddy really does).  Reported in GB/s (1e9 bytes/s) and as a ratio to
  a plain memory copy (``numpy.copyto``) of the same bytes measured in the same
  run, so the ratio stays meaningful on other machines.

Everything goes through ``open_transport``, so this measures the code actors
use.  Every figure is the median over ``--reps`` repetitions after a warm-up.

Usage::

    python bench/transport.py            # defaults: under ~60 s on 2 cores
    python bench/transport.py --quick    # a few seconds: smoke check
    python bench/transport.py --json     # one JSON object per row instead of the table
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent


def _make_importable() -> None:
    """TEMPORARY, the same shim as tests/conftest.py: until ``pip install -e .``
    provides ``deadpool.transports``, load the top-level ``transports/`` folder
    under that name (also in the spawned buddy process, which re-imports this file).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import deadpool

    try:
        import deadpool.transports
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "deadpool.transports",
            ROOT / "transports" / "__init__.py",
            submodule_search_locations=[str(ROOT / "transports")],
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["deadpool.transports"] = module
        spec.loader.exec_module(module)
        deadpool.transports = module  # type: ignore[attr-defined]


_make_importable()

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from deadpool.protocol.codec import decode, encode  # noqa: E402
from deadpool.protocol.messages import Heartbeat, SnapshotAck, SnapshotHeader, Stop  # noqa: E402
from deadpool.protocol.transport import Limits, Transport, open_transport  # noqa: E402

SECRET = b"bench-shared-secret"
SEND_TIMEOUT = 10.0  # one send on loopback; reaching it means something is broken
RECV_TIMEOUT = 30.0  # one message or one whole snapshot's ack
STARTUP_TIMEOUT = 30.0  # the buddy process imports numpy and binds
JOIN_TIMEOUT = 10.0
GB = 1e9

T = TypeVar("T")


# --- plumbing -----------------------------------------------------------------------------------


def run_loop(main: Callable[[], Coroutine[Any, Any, T]], loop: str) -> T:
    """Run `main` on the loop DeadPool's runtime thread uses (uvloop) unless told otherwise."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    return asyncio.run(main())


class Urls:
    """Fresh bindable URLs per scheme (private ipc directory, unique inproc names)."""

    def __init__(self, ipc_dir: Path) -> None:
        self._ipc_dir = ipc_dir
        self._count = 0

    def fresh(self, scheme: str) -> str:
        self._count += 1
        if scheme == "tcp":
            return "tcp://127.0.0.1:0"
        if scheme == "ipc":
            return f"ipc://{self._ipc_dir}/ep{self._count}"
        return f"inproc://bench-{os.getpid()}-{self._count}"


async def with_readers(transports: list[Transport], body: Callable[[], Awaitable[T]]) -> T:
    """Run `body` while every transport's reader runs; close them all afterwards, always."""
    async with asyncio.TaskGroup() as group:
        for transport in transports:
            group.create_task(transport.run())
        try:
            return await body()
        finally:
            for transport in transports:
                await transport.close()  # makes every run() return, so the group can exit


async def recv_one(transport: Transport) -> list[memoryview]:
    return await asyncio.wait_for(transport.recv(), RECV_TIMEOUT)


# --- control messages ---------------------------------------------------------------------------


async def control_rates(scheme: str, secret: bytes | None, messages: int, reps: int, urls: Urls) -> list[float]:
    """Messages per second for `reps` rounds of `messages` heartbeats, pipelined."""
    receiver, sender = open_transport(urls.fresh(scheme)), open_transport(urls.fresh(scheme))

    async def round_trip(count: int) -> float:
        async def produce() -> None:
            for step in range(count):
                heartbeat = Heartbeat("bench-host:4242:5f3a", 7, step, step - 1, step - 2, 0.0021,
                                      "tcp://10.0.3.17:41234")
                await sender.send(receiver.address, [encode(heartbeat, secret)], SEND_TIMEOUT)

        async def consume() -> None:
            for _ in range(count):
                message = decode((await recv_one(receiver))[0], secret)
                if not isinstance(message, Heartbeat):
                    raise RuntimeError(f"benchmark heartbeat refused: {message}")

        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            group.create_task(produce())
            group.create_task(consume())
        return time.perf_counter() - start

    async def body() -> list[float]:
        await round_trip(min(messages, 1000))  # warm-up: connect, fill caches
        return [messages / await round_trip(messages) for _ in range(reps)]

    return await with_readers([receiver, sender], body)


# --- inbound control (many senders, one receiver) -------------------------------------------------

SENDERS = 4
INBOUND_MESSAGES = 40_000  # enough for a steady state: a short burst is mostly the senders starting


def sender_main(address: str, count: int, loop: str) -> None:
    """Entry point of a sender process: `count` heartbeats to `address`, as fast as they are accepted."""

    async def send_all() -> None:
        sender = open_transport("tcp://127.0.0.1:0")
        frame = encode(Heartbeat("bench-host:4242:5f3a", 7, 3, 2, 1, 0.0021, "tcp://10.0.3.17:41234"))

        async def body() -> None:
            for _ in range(count):
                await sender.send(address, [frame], SEND_TIMEOUT)

        await with_readers([sender], body)
        await sender.close(linger=RECV_TIMEOUT)  # what is queued leaves before the process does

    run_loop(send_all, loop)


def _spawn_senders(address: str, messages: int, loop: str) -> tuple[list[multiprocessing.process.BaseProcess], int]:
    """SENDERS processes sending about `messages` in all to `address`; also how many arrive after the first."""
    spawn = multiprocessing.get_context("spawn")  # no fork of a process holding ZeroMQ state
    count = messages // SENDERS
    processes: list[multiprocessing.process.BaseProcess] = [
        spawn.Process(target=sender_main, args=(address, count, loop), daemon=True, name=f"sender-{i}")
        for i in range(SENDERS)]
    for process in processes:
        process.start()
    return processes, SENDERS * count - 1


def _join(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        process.join(JOIN_TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join(JOIN_TIMEOUT)


async def inbound_cpu(messages: int, loop: str, urls: Urls) -> float:
    """The receiving process's CPU microseconds per message (received and decoded) from SENDERS processes."""
    receiver = open_transport(urls.fresh("tcp"))
    processes, timed = _spawn_senders(receiver.address, messages, loop)

    async def body() -> float:
        decode((await recv_one(receiver))[0])  # the first one starts the clock: the senders are up
        started = time.process_time()
        async with asyncio.timeout(RECV_TIMEOUT):  # one bound for the whole burst: no timer per message
            for _ in range(timed):
                decode((await receiver.recv())[0])
        return (time.process_time() - started) * 1e6 / timed

    try:
        return await with_readers([receiver], body)
    finally:
        await asyncio.to_thread(_join, processes)


def raw_inbound_cpu(messages: int, loop: str, urls: Urls) -> float:
    """The same traffic into a plain blocking pyzmq PULL socket, decoded: the floor for `inbound_cpu`."""
    pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    processes, timed = _spawn_senders(f"tcp://127.0.0.1:{port}", messages, loop)
    try:
        pull.setsockopt(zmq.RCVTIMEO, int(RECV_TIMEOUT * 1000))
        decode(pull.recv_multipart(copy=False)[0].buffer)
        started = time.process_time()
        for _ in range(timed):
            decode(pull.recv_multipart(copy=False)[0].buffer)
        return (time.process_time() - started) * 1e6 / timed
    finally:
        pull.close(linger=0)
        _join(processes)


# --- snapshot streaming -------------------------------------------------------------------------


def stream_limits(frame_bytes: int) -> Limits:
    """Bulk endpoints: frames as big as a chunk, [header, chunk] messages, short queues."""
    return Limits(max_frame_bytes=frame_bytes, max_frames=2, inbox_size=8, send_hwm=4)


def buddy_main(url: str, frame_bytes: int, total: int, store: bool, loop: str, conn: Connection) -> None:
    """Entry point of the buddy process: receive snapshots, acknowledge each whole one."""
    run_loop(lambda: buddy(url, frame_bytes, total, store, conn), loop)


async def buddy(url: str, frame_bytes: int, total: int, store: bool, conn: Connection) -> None:
    receiver = open_transport(url, stream_limits(frame_bytes))
    arena = np.ones(total, dtype=np.uint8) if store else None  # preallocated and touched

    async def body() -> None:
        conn.send(receiver.address)
        received = 0
        while True:
            frames = await recv_one(receiver)
            message = decode(frames[0])
            if isinstance(message, Stop):
                return
            if not isinstance(message, SnapshotHeader) or len(frames) != 2:
                raise RuntimeError(f"buddy got an unexpected message: {message}")
            chunk = frames[1]
            if arena is not None:
                arena[received : received + chunk.nbytes] = np.frombuffer(chunk, dtype=np.uint8)
            received += chunk.nbytes
            if received == message.nbytes:
                ack = SnapshotAck("bench-buddy", message.epoch, message.seat, message.step)
                await receiver.send(message.sender, [encode(ack)], SEND_TIMEOUT)
                received = 0

    await with_readers([receiver], body)


async def stream_rates(
    scheme: str, total: int, frame_bytes: int, reps: int, store: bool, loop: str, urls: Urls
) -> list[float]:
    """Bytes per second streaming `total` bytes to a buddy process, until its ack."""
    seat = open_transport(urls.fresh(scheme), stream_limits(frame_bytes))
    source = np.ones(total, dtype=np.uint8)  # stands in for the snapshot arena
    view = source.data  # a memoryview of the arena: slices are zero-copy
    spawn = multiprocessing.get_context("spawn")  # no fork of a process holding ZeroMQ state
    parent_conn, child_conn = spawn.Pipe(duplex=False)
    process = spawn.Process(
        target=buddy_main,
        args=(urls.fresh(scheme), frame_bytes, total, store, loop, child_conn),
        name=f"buddy-{scheme}",
        daemon=True,
    )
    process.start()

    async def stream_once(step: int, buddy_address: str) -> float:
        header = encode(SnapshotHeader(seat.address, 1, 0, step, total, b""))
        start = time.perf_counter()
        for offset in range(0, total, frame_bytes):
            await seat.send(buddy_address, [header, view[offset : offset + frame_bytes]], SEND_TIMEOUT)
        ack = decode((await recv_one(seat))[0])
        if not isinstance(ack, SnapshotAck) or ack.step != step:
            raise RuntimeError(f"expected the ack of step {step}, got {ack}")
        return time.perf_counter() - start

    async def body() -> list[float]:
        ready = await asyncio.to_thread(parent_conn.poll, STARTUP_TIMEOUT)
        if not ready:
            raise RuntimeError(f"buddy process did not start within {STARTUP_TIMEOUT:.0f}s")
        buddy_address: str = parent_conn.recv()
        await stream_once(-1, buddy_address)  # warm-up: connect, fault in the buddy's pages
        rates = [total / await stream_once(step, buddy_address) for step in range(reps)]
        await seat.send(buddy_address, [encode(Stop(True, "benchmark done"))], SEND_TIMEOUT)
        return rates

    try:
        return await with_readers([seat], body)
    finally:
        await asyncio.to_thread(process.join, JOIN_TIMEOUT)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, JOIN_TIMEOUT)


def memcpy_rates(total: int, reps: int) -> list[float]:
    """Bytes per second of one flat numpy copy of `total` bytes (pages touched beforehand)."""
    source = np.ones(total, dtype=np.uint8)
    target = np.zeros(total, dtype=np.uint8)
    np.copyto(target, source)
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(target, source)
        rates.append(total / (time.perf_counter() - start))
    return rates


# --- reporting ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    messages: int  # heartbeats per control round
    snapshot_bytes: int  # bytes per streamed snapshot
    frame_bytes: int  # bytes per zero-copy frame
    reps: int  # measured repetitions (after one warm-up)
    loop: str  # asyncio or uvloop


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def collect(settings: Settings, urls: Urls, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for scheme in ("tcp", "ipc", "inproc"):
        for secret in (None, SECRET):
            progress(f"control {scheme} hmac={secret is not None}")
            rates = run_loop(
                lambda: control_rates(scheme, secret, settings.messages, settings.reps, urls), settings.loop
            )
            stats = summary(rates)
            rows.append(
                {
                    "bench": "control",
                    "transport": scheme,
                    "hmac": secret is not None,
                    "messages": settings.messages,
                    "reps": settings.reps,
                    "msgs_per_s": stats["median"],
                    "msgs_per_s_min": stats["min"],
                    "msgs_per_s_max": stats["max"],
                    "us_per_msg": 1e6 / stats["median"],
                }
            )
    progress(f"inbound: {SENDERS} senders, raw pyzmq and DeadPool's transport, alternately")
    raw: list[float] = []
    ours: list[float] = []
    for _ in range(settings.reps):
        raw.append(raw_inbound_cpu(INBOUND_MESSAGES, settings.loop, urls))
        ours.append(run_loop(lambda: inbound_cpu(INBOUND_MESSAGES, settings.loop, urls), settings.loop))
    rows.append({"bench": "inbound", "transport": "tcp", "senders": SENDERS, "messages": INBOUND_MESSAGES,
                 "reps": settings.reps, "raw_us_per_msg": statistics.median(raw),
                 "us_per_msg": statistics.median(ours), "us_per_msg_min": min(ours), "us_per_msg_max": max(ours),
                 "ratio_to_raw": statistics.median(o / r for o, r in zip(ours, raw, strict=True))})
    progress("memcpy")
    copy = summary(memcpy_rates(settings.snapshot_bytes, settings.reps))
    stream_common = {"bytes": settings.snapshot_bytes, "frame_bytes": settings.frame_bytes, "reps": settings.reps}
    rows.append(
        {"bench": "stream", "transport": "memcpy", "mode": "np.copyto", **stream_common}
        | {"gb_per_s": copy["median"] / GB, "gb_per_s_min": copy["min"] / GB, "gb_per_s_max": copy["max"] / GB}
        | {"ratio_to_memcpy": 1.0}
    )
    for scheme in ("tcp", "ipc"):
        for store in (False, True):
            progress(f"stream {scheme} store={store}")
            rates = run_loop(
                lambda: stream_rates(
                    scheme, settings.snapshot_bytes, settings.frame_bytes, settings.reps, store, settings.loop, urls
                ),
                settings.loop,
            )
            stats = summary(rates)
            rows.append(
                {"bench": "stream", "transport": scheme, "mode": "recv+store" if store else "recv", **stream_common}
                | {"gb_per_s": stats["median"] / GB, "gb_per_s_min": stats["min"] / GB}
                | {"gb_per_s_max": stats["max"] / GB, "ratio_to_memcpy": stats["median"] / copy["median"]}
            )
    return rows


def render(rows: list[dict[str, Any]], settings: Settings) -> str:
    mb = 1 << 20
    lines = [
        f"DeadPool transport benchmark: python {platform.python_version()}, pyzmq {zmq.__version__} "
        f"(libzmq {zmq.zmq_version()}), loop {settings.loop}, {os.cpu_count()} CPUs, "
        f"median (min..max) of {settings.reps} reps after a warm-up",
        "",
        f"control messages: Heartbeat encode+send+recv+decode, {settings.messages} per rep, one loop",
        f"{'transport':<10} {'hmac':<5} {'msgs/s':>10} {'us/msg':>7}   {'min..max msgs/s':<20}",
    ]
    for row in rows:
        if row["bench"] == "control":
            lines.append(
                f"{row['transport']:<10} {'yes' if row['hmac'] else 'no':<5} {row['msgs_per_s']:>10,.0f} "
                f"{row['us_per_msg']:>7.1f}   {row['msgs_per_s_min']:,.0f}..{row['msgs_per_s_max']:,.0f}"
            )
    for row in rows:
        if row["bench"] == "inbound":
            lines += [
                "",
                f"inbound control: {row['senders']} sender processes, {row['messages']} heartbeats into one tcp "
                "endpoint, received and decoded; the receiver's CPU per message",
                f"{'transport':<10} {'us/msg':>7} {'raw pyzmq us/msg':>17} {'ratio':>6}   {'min..max us/msg':<16}",
                f"{row['transport']:<10} {row['us_per_msg']:>7.1f} {row['raw_us_per_msg']:>17.1f} "
                f"{row['ratio_to_raw']:>6.2f}   {row['us_per_msg_min']:.1f}..{row['us_per_msg_max']:.1f}",
            ]
    lines += [
        "",
        f"snapshot streaming: {settings.snapshot_bytes // mb} MB in {settings.frame_bytes // mb} MB zero-copy "
        f"frames to a buddy process, until its ack (GB = 1e9 bytes)",
        f"{'transport':<10} {'mode':<11} {'GB/s':>6} {'vs memcpy':>10}   {'min..max GB/s':<14}",
    ]
    for row in rows:
        if row["bench"] == "stream":
            lines.append(
                f"{row['transport']:<10} {row['mode']:<11} {row['gb_per_s']:>6.2f} {row['ratio_to_memcpy']:>10.2f}   "
                f"{row['gb_per_s_min']:.2f}..{row['gb_per_s_max']:.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import results
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 reps: a few seconds")
    results.json_option(parser, "one JSON object per row instead of the table")
    parser.add_argument("--messages", type=int, help="heartbeats per control round (default 20000, quick 2000)")
    parser.add_argument("--snapshot-mb", type=int, help="MB per streamed snapshot (default 256, quick 32)")
    parser.add_argument("--frame-mb", type=int, default=8, help="MB per zero-copy frame (default 8)")
    parser.add_argument("--reps", type=int, help="measured repetitions (default 5, quick 3)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    args = parser.parse_args(argv)
    settings = Settings(
        messages=args.messages or (2000 if args.quick else 20000),
        snapshot_bytes=(args.snapshot_mb or (32 if args.quick else 256)) << 20,
        frame_bytes=args.frame_mb << 20,
        reps=args.reps or (3 if args.quick else 5),
        loop=args.loop,
    )
    if settings.snapshot_bytes % settings.frame_bytes:
        parser.error("--snapshot-mb must be a multiple of --frame-mb")

    def progress(what: str) -> None:
        print(f"  measuring {what} ...", file=sys.stderr, flush=True)

    ipc_dir = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    started = time.perf_counter()
    try:
        rows = collect(settings, Urls(ipc_dir), progress)
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if args.json and args.json != "-":
        results.write(args.json, "transport", rows, settings=asdict(settings))
    if args.json == "-":
        for row in rows:
            print(json.dumps(row))
    else:
        print(render(rows, settings))
        print(f"\n(total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
