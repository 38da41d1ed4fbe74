"""``deadpool launch``: the per-host agent.

It starts the coordinator (on the first host, unless one is given), then this
host's workers (``--nproc`` actives and ``--spares`` spares) with torchrun's
environment contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus DeadPool's own variables.  Unlike
torchrun's agent it does **not** stop the other workers when one dies: it
reports the exit to the coordinator (the fastest failure detector there is)
and keeps going, so a spare can take the seat.  It also carries out the
coordinator's fence-by-kill for members declared dead on this host, forwards
every worker's output with a prefix, and exits non-zero if the job failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deadpool.agent import closing, coordinators, determinism, exits, jobfile, progress, relay, verdict
from deadpool.agent.checks import validate, visible_steps
from deadpool.agent.forked import ForkedWorker, Starter
from deadpool.agent.heapenv import worker_heap_env
from deadpool.agent.preemption import Drain
from deadpool.agent.relay import AckBatcher, BeatRelay
from deadpool.agent.threadenv import omp_threads_env
from deadpool.chaos import SIGNALS, ChaosAction, ChaosSpec, applies, host_specs
from deadpool.chaos import parse as parse_chaos
from deadpool.config import Backend, Config, raise_priority
from deadpool.events import schema, summary
from deadpool.events.log import EventLog
from deadpool.events.summary import ChaosNotFired
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink, StandDown
from deadpool.protocol.messages import (
    AgentHello,
    Coordinators,
    FenceKill,
    Heartbeat,
    MoveResult,
    PrepareAck,
    ProcessExited,
    Relay,
    SignalMember,
    SilenceQuery,
    SilenceReport,
    StartStandby,
    Stop,
    Welcome,
)
from deadpool.protocol.transport import AGENT_LIMITS, Transport, TransportError, address_host, open_transport
from deadpool.snapshot import shm

log = logging.getLogger("deadpool.agent.launch")

DROP_LOG_INTERVAL = 10.0  # seconds between two lines about dropped frames (each line counts the drops it covers)
WORKER_EXIT_GRACE = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OUTPUT_DRAIN_GRACE = 5.0  # the workers' groups are gone: their output is read this long at most (a setsid child)


@dataclass
class Worker:
    label: str
    member: str
    role: str
    proc: asyncio.subprocess.Process | ForkedWorker
    seat_hint: int = -1  # RANK, -1 for a spare
    returncode: int | None = None


async def _forward(worker: Worker, labels: SeatLabels) -> None:
    stream = worker.proc.stdout
    assert stream is not None
    while line := await stream.readline():
        if worker.role == "spare":
            labels.refresh()
        sys.stdout.write(f"[{worker.label}] {line.decode(errors='replace')}")
        sys.stdout.flush()


class SeatLabels:
    """A spare of this host that took a seat prints as that seat from then on (``[rank0 spare0]``): the restore
    its process wrote to this host's events file, before any line of its first step, says which."""

    def __init__(self, events_path: str, workers: list[Worker]) -> None:
        self._spares = {w.member: w for w in workers if w.role == "spare"}
        self._tail = progress.EventTail(events_path)

    def refresh(self) -> None:
        """Relabel the spares seated since the last call (reads only what was appended to the events file)."""
        if not self._spares:
            return
        for record in self._tail.read():
            match summary.parse(record):
                case summary.Restore(member=member, rank=rank) if member in self._spares and rank is not None \
                        and rank >= 0:
                    worker = self._spares.pop(member)
                    worker.label = f"rank{rank} {worker.label}"


class DropLog:
    """Logs every frame the agent drops, and why: the first at once, then at most one line per `interval`.

    A flood (a peer with the wrong secret retrying every 100 ms) becomes one line
    per interval that counts what it stands for, instead of a line per frame.
    """

    def __init__(self, interval: float = DROP_LOG_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._next = -math.inf  # when the next line may be written
        self._held = 0  # drops since the last line
        self.dropped = 0  # drops in all

    def note(self, why: str) -> bool:
        """Count one dropped frame; returns whether a line was written for it."""
        self.dropped += 1
        self._held += 1
        now = self._clock()
        if now < self._next:
            return False
        more = f" (and {self._held - 1} more dropped frames since the last report)" if self._held > 1 else ""
        log.warning("dropped a frame from the control socket: %s%s", why, more)
        self._held = 0
        self._next = now + self._interval
        return True


class Launcher:
    """One host's agent: owns the worker processes it starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = args.nnodes * args.nproc
        self.host = args.host_name or socket.gethostname()
        self.agent_id = f"agent-{self.host}-{os.getpid()}-{secrets.token_hex(2)}"
        self.workers: list[Worker] = []
        self.stop: Stop | None = None
        self.stop_event = asyncio.Event()
        self.transport: Transport | None = None
        self.secret = b""
        self.link = CoordinatorLink("")  # the active coordinator of the newest term heard, and its standby
        self.events_path = ""
        self.env: dict[str, str] = {}
        self.shm_dir = ""  # where this host's workers keep their snapshot slot files (removed after they exit)
        self.welcomed = False
        self.ever_welcomed = False  # the coordinator answered once: from then on, silence means a cut
        self.coordinator_gone = False  # the job's outcome is known here: nobody needs this host's reports
        self.coordinator_proc: asyncio.subprocess.Process | None = None  # the local coordinator, if this agent runs it
        self.standby_proc: asyncio.subprocess.Process | None = None  # the local standby coordinator, if any
        self._early: list[asyncio.Task[None]] = []  # the transport and the hellos, started before the workers
        self._preempt = sorted((spec for spec in map(parse_chaos, args.chaos)
                                if spec.action is ChaosAction.PREEMPT and spec.host == args.node_rank),
                               key=lambda spec: spec.step)  # this host's preemption specs, not yet fired
        self.drain: Drain | None = None  # a preemption notice (SIGTERM to this host alone) being answered
        self.drained = False  # this host's seats moved to other hosts and its workers left: it exits 0
        self.starter = Starter()  # forks this host's workers from one server, or starts fresh interpreters
        self._outcome: asyncio.Future[int] | None = None  # this host's exit status, once known
        self.job_file: Path | None = None  # where operator tools on this host find the job (coordinator hosts)
        self._kept: set[asyncio.Task[None]] = set()  # tasks started from the inbox (a standby asked for)
        self.stopped_by = 0  # the signal (SIGTERM, SIGINT) that stopped the job on this host, 0: none
        self.last_contact = time.monotonic()  # last answer from the coordinator (it answers every hello)
        self._drops = DropLog()  # frames the inbox could not use
        self.relay = BeatRelay(self.agent_id, [])  # this host's workers' heartbeats, one message per interval
        self._hello_frame: tuple[int, bytes] | None = None  # (workers named, the encoded AgentHello naming them)
        self.acks = AckBatcher(self.agent_id, [])  # ... and their answers to a Prepare, together

    def _config_env(self) -> dict[str, str]:
        overrides: dict[str, Any] = {}
        if self.args.failure_timeout is not None:
            overrides["failure_timeout"] = self.args.failure_timeout
        if self.args.heartbeat_interval is not None:
            overrides["heartbeat_interval"] = self.args.heartbeat_interval
        if self.args.snapshot_every is not None:
            overrides["snapshot_every"] = self.args.snapshot_every
        if self.args.no_fence_kill:
            overrides["fence_by_kill"] = False
        for name in ("slow_threshold", "slow_steps", "slow_reserve", "replica_checks"):
            if getattr(self.args, name, None) is not None:
                overrides[name] = getattr(self.args, name)
        overrides.update({name: bool(getattr(self.args, name, False)) for name in ("replace_slow", "audit")})
        overrides["total_steps"] = visible_steps(self.args.script_args) or 0
        if getattr(self.args, "shm_dir", None) is not None:
            overrides["shm_dir"] = str(Path(self.args.shm_dir).resolve()) if self.args.shm_dir else ""
        if self.args.checkpoint_every or self.args.checkpoint_dir:
            overrides["checkpoint_every"] = self.args.checkpoint_every
            folder = self.args.checkpoint_dir
            overrides["checkpoint_dir"] = str(Path(folder).resolve()) if folder else ""
            overrides["resume"] = bool(getattr(self.args, "resume", False))
        # Every job is authenticated: a given secret (required across hosts), else a fresh one per job,
        # which the job file hands to operator tools on this host.
        secret = os.environ.get("DEADPOOL_SECRET") or secrets.token_hex(16)
        config = Config.from_env(**overrides, secret=secret)
        self.secret = config.secret.encode()
        self.shm_dir = config.shm_dir
        return config.to_env()

    async def run(self) -> int:
        args = self.args
        events = args.events or str(Path(tempfile.mkdtemp(prefix="deadpool-")) / "events.jsonl")
        self.events_path = events
        env = {**os.environ, **self._config_env()}
        self.env = env
        threads, notice = omp_threads_env(os.environ, args.nproc + args.spares)
        if notice:
            print(f"deadpool: {notice}", file=sys.stderr, flush=True)
        stale = shm.sweep_stale(self.shm_dir)  # left by an agent that was itself killed
        if stale:
            print(f"deadpool: removed {len(stale)} snapshot slot file(s) of processes that no longer exist "
                  f"from {self.shm_dir}", file=sys.stderr, flush=True)
        shared_env = {**env, **worker_heap_env(env), **threads, "PYTHONUNBUFFERED": "1"}
        await self.starter.open(getattr(args, "start_method", "fork"), shared_env, args.script, args.script_args)
        coordinator_proc = None
        if args.node_rank == 0 and not args.coordinator:
            coordinator_proc, self.link.active, store = await coordinators.start(args, self.world, events, env)
        else:
            self.link.active = args.coordinator
            store = f"{args.master_addr or address_host(args.coordinator)}:{args.master_port}"
        if coordinators.standby_wanted(args):
            await self._start_standby()
        bind = args.bind_host or args.master_addr or "127.0.0.1"
        self.transport = open_transport(f"tcp://{bind}:0", AGENT_LIMITS)
        store_host, store_port = store.rsplit(":", 1)
        spec = ",".join(args.chaos)
        base = {**shared_env, "DEADPOOL_COORDINATOR": self.link.active,
                "DEADPOOL_EVENTS": events, "DEADPOOL_CHAOS": spec, "DEADPOOL_HOST": self.host,
                "DEADPOOL_BACKEND": getattr(args, "backend", Backend.AUTO),
                "DEADPOOL_BIND_HOST": bind, "WORLD_SIZE": str(self.world if args.nproc else 0),
                "MASTER_ADDR": store_host, "MASTER_PORT": store_port,
                "LOCAL_WORLD_SIZE": str(args.nproc),
                "DEADPOOL_AGENT": self.transport.address, "DEADPOOL_AGENT_PID": str(os.getpid())}  # relay.py
        if coordinator_proc is not None or self.standby_proc is not None:
            self._write_job_file()
            if coordinator_proc is not None:
                print(f"deadpool: coordinator {self.link.active}; events {events}", flush=True)
        # The coordinator hears this host while its workers start (the fork server may take seconds to load).
        self._early = [asyncio.create_task(self.transport.run()), asyncio.create_task(self._hello())]
        for local in range(args.nproc + args.spares):
            spare = local >= args.nproc
            rank = -1 if spare else args.node_rank * args.nproc + local
            label = f"spare{local - args.nproc}" if spare else f"rank{rank}"
            member = f"{self.host}:{label}:{secrets.token_hex(3)}"
            worker_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "DEADPOOL_MEMBER_ID": member,
                          "DEADPOOL_ROLE": "spare" if spare else "active",
                          "DEADPOOL_SPARE_INDEX": str(local - args.nproc if spare else -1)}
            proc = await self.starter.start(args.script, args.script_args, worker_env)
            self.workers.append(Worker(label, member, "spare" if spare else "active", proc, rank))
        await self.starter.close()  # every worker has started: the fork server's memory goes back
        self.relay = BeatRelay(self.agent_id, [w.member for w in self.workers])
        self.acks = AckBatcher(self.agent_id, [w.member for w in self.workers])
        self.coordinator_proc = coordinator_proc
        main = asyncio.current_task()
        assert main is not None
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:  # a scheduler stopping the job, or Ctrl-C; kept until the workers are gone
            loop.add_signal_handler(signum, self._on_stop_signal, main, signum)
        try:
            return await self._supervise(coordinator_proc)
        except asyncio.CancelledError:
            if not self.stopped_by:
                raise
            return 128 + self.stopped_by
        finally:
            for early in self._early:
                early.cancel()
            await self._terminate_all()
            for child in (self.coordinator_proc, self.standby_proc):
                if child is not None and child.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.terminate()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(child.wait(), 3.0)
            for worker in self.workers:
                self._remove_shm_files(worker)
            await self.transport.close()
            if self.job_file is not None:
                jobfile.remove(self.job_file)
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)
                if self.stopped_by:  # the exit status is decided: a Ctrl-C pressed again now must not kill the launcher
                    signal.signal(signum, signal.SIG_IGN)

    def _on_stop_signal(self, main: asyncio.Task[int], signum: int) -> None:
        """SIGTERM (SLURM, Kubernetes, kill) or SIGINT (Ctrl-C): stop every worker and the coordinator, remove
        their files.  Another one meanwhile (Ctrl-C pressed twice) does not cut that short: the workers run in
        sessions of their own, where no terminal's signal reaches them, and would be left running."""
        name = signal.Signals(signum).name
        if (signum == signal.SIGTERM and self.args.nnodes > 1 and self.drain is None and not self.stopped_by
                and self.transport is not None and self.welcomed):
            timeout = getattr(self.args, "drain_timeout", 25.0)
            print(f"deadpool: SIGTERM: a preemption notice; draining this host (its seats move to spares on other "
                  f"hosts within {timeout:g} s)", file=sys.stderr, flush=True)
            self.drain = Drain(self.host, self.secret, timeout)
            self._keep(self._drain(main))
            return
        if self.stopped_by:
            print(f"deadpool: {name}: still stopping this host's workers (SIGKILL after 3 s)", file=sys.stderr,
                  flush=True)
            return
        print(f"deadpool: {name}: stopping this host's workers", file=sys.stderr, flush=True)
        self.stopped_by = signum
        main.cancel()

    async def _drain(self, main: asyncio.Task[int]) -> None:
        """Answer a preemption notice: drain this host and exit 0, or stop its workers as on any SIGTERM."""
        assert self.drain is not None and self.transport is not None
        why = await self.drain.run(self.transport, self.link, lambda: sum(w.returncode is None for w in self.workers))
        if why:
            print(f"deadpool: {why}; stopping this host's workers instead", file=sys.stderr, flush=True)
            self._on_stop_signal(main, signal.SIGTERM)
            return
        self.drained = True
        print(f"deadpool: host {self.host} drained: its seats moved to spares on other hosts", flush=True)
        self._decide(0)

    async def _supervise(self, coordinator_proc: asyncio.subprocess.Process | None) -> int:
        assert self.transport is not None
        async with asyncio.TaskGroup() as tasks:
            background = [tasks.create_task(_awaited(early)) for early in self._early]
            background.append(tasks.create_task(self._inbox()))
            background.append(tasks.create_task(relay.forward(self.relay, self.transport, self.link,
                                                              Config.from_env(self.env).heartbeat_interval,
                                                              self.secret)))
            background.append(tasks.create_task(self._watch_contact()))
            background.append(tasks.create_task(self.starter.reap_orphans()))
            if not getattr(self.args, "no_progress", False):
                background.append(tasks.create_task(progress.follow(self.events_path, self.world,
                                                                    self.args.spares)))
            labels = SeatLabels(self.events_path, self.workers)
            forwards = [tasks.create_task(_forward(w, labels)) for w in self.workers]
            watches = [tasks.create_task(self._watch(w)) for w in self.workers]
            self._outcome = asyncio.get_running_loop().create_future()
            background.append(tasks.create_task(self._stopped()))
            if coordinator_proc is not None:
                background.append(tasks.create_task(self._active_lifetime(coordinator_proc)))
            if self.standby_proc is not None:
                background.append(tasks.create_task(self._standby_lifetime(self.standby_proc)))
            code = await self._outcome
            self.coordinator_gone = True
            ok = code == 0
            grace = WORKER_EXIT_GRACE if ok else 2.0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*watches, return_exceptions=True), grace)
            await self._terminate_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*forwards, return_exceptions=True), OUTPUT_DRAIN_GRACE)
            for task in background:
                task.cancel()
        return 0 if ok else 1

    def _decide(self, code: int) -> None:
        """This host's exit status is known (the first source wins: a local coordinator's end or a Stop)."""
        if self._outcome is not None and not self._outcome.done():
            self._outcome.set_result(code)

    async def _stopped(self) -> None:
        await self.stop_event.wait()
        self._decide(0 if self.stop and self.stop.ok else 1)

    async def _active_lifetime(self, proc: asyncio.subprocess.Process) -> None:
        """The local coordinator's end decides the job, unless a newer term took over (then a Stop will)."""
        async def restart() -> asyncio.subprocess.Process:
            started, _, _ = await coordinators.start(self.args, self.world, self.events_path, self.env,
                                                     bind=self.link.active, recover=True)
            self.coordinator_proc = started
            return started

        ended = await coordinators.active_lifetime(proc, restart, lambda: self.stop is not None)
        if ended is StandDown.CUT_OFF:
            reason = ("this host's coordinator heard too few hosts for the view timeout and stood down: this host "
                      "is cut off; its members were replaced. Stopping this host's workers.")
            print(f"deadpool: {reason}", file=sys.stderr, flush=True)
            self.stop = Stop(False, reason)
            self.stop_event.set()
        elif ended is StandDown.SUPERSEDED:
            print("deadpool: this host's coordinator stood down: a newer term's coordinator runs the job",
                  file=sys.stderr, flush=True)
        else:
            self._decide(ended)

    async def _standby_lifetime(self, proc: asyncio.subprocess.Process) -> None:
        code = await coordinators.standby_lifetime(proc)
        if code is not None:
            self._decide(code)

    async def _start_standby(self) -> None:
        """Run the standby coordinator on this host (at start, or when the active asks after losing one)."""
        if self.standby_proc is not None and self.standby_proc.returncode is None:
            return
        self.standby_proc, address, _ = await coordinators.start(self.args, self.world, self.events_path, self.env,
                                                                 standby_of=self.link.active)
        self.link.standby = address
        print(f"deadpool: standby coordinator {address} (of {self.link.active})", flush=True)
        if self._outcome is not None:  # started while the job runs: its end must be watched too
            self._keep(self._standby_lifetime(self.standby_proc))

    async def _pass_on(self, header: Relay, frame: memoryview) -> None:
        """A coordinator's broadcast for this host's workers (``relay.pass_on``); a miss is only noted: the
        coordinator sends a lost Prepare or view again directly (``coordinator/fanout.py``)."""
        assert self.transport is not None
        for addr in await relay.pass_on(self.transport, header, frame, 1.0):
            self._drops.note(f"relay to {addr}: not reachable")

    async def _send_acks(self) -> None:
        """The workers' answers that came within the window, as one message; retried while the coordinator
        cannot take it (a worker whose answer went through its agent does not send it again)."""
        assert self.transport is not None
        await asyncio.sleep(relay.ACK_WINDOW_S)
        for _ in range(10):
            batch = self.acks.take()
            if batch is None:
                return
            try:
                await self.transport.send(self.link.active, [codec.encode(batch, self.secret)], 1.0)
                return
            except TransportError as err:
                self._drops.note(f"answers to Prepare not sent yet: {err}")
                self.acks.put_back(batch)
                await asyncio.sleep(0.1)

    def _keep(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` beside the inbox, holding its task until it ends (the loop keeps only weak references)."""
        task = asyncio.get_running_loop().create_task(work)
        self._kept.add(task)
        task.add_done_callback(self._kept.discard)

    async def _watch_contact(self) -> None:
        """A host cut off from the coordinator stops its own workers after a bound.

        Its actives were replaced long ago (missed heartbeats) and its spares can no
        longer be adopted; without this they would wait for a Stop that cannot
        arrive.  The bound is the view timeout: far longer than a coordinator restart or
        a takeover; before the coordinator first answered, the startup timeout (at start
        every process of every host imports torch at once, the coordinator's store too).
        """
        config = Config.from_env(self.env)
        while self.stop is None:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - self.last_contact
            bound, name = (config.view_timeout, "view") if self.ever_welcomed else (config.startup_timeout, "startup")
            if silent > bound:
                reason = (f"no answer from the coordinator at {self.link.active} for {silent:.0f}s "
                          f"({name} timeout {bound:.0f}s): this host is cut off; its members were replaced. "
                          "Stopping this host's workers.")
                print(f"deadpool: {reason}", file=sys.stderr, flush=True)
                self.stop = Stop(False, reason)
                self.stop_event.set()
                return

    async def _hello(self) -> None:
        """Register with the coordinator, and keep repeating it: a restarted coordinator must re-learn us."""
        while True:
            await self._announce()
            await asyncio.sleep(0.1 if not self.welcomed else relay.HELLO_EVERY_S)

    async def _announce(self, only_new: bool = False) -> None:
        """Send the AgentHello of the workers started so far (to the standby too); `only_new`: only if it changed."""
        assert self.transport is not None
        if self._hello_frame is None or self._hello_frame[0] != len(self.workers):  # the workers as they start
            only_new, hello = False, AgentHello(self.agent_id, self.host, self.transport.address,
                                                {w.member: w.proc.pid for w in self.workers})
            self._hello_frame = (len(self.workers), codec.encode(hello, self.secret))
        for addr in [] if only_new else [a for a in dict.fromkeys([self.link.active, self.link.standby]) if a]:
            with contextlib.suppress(TransportError):
                await self.transport.send(addr, [self._hello_frame[1]], 1.0)

    async def _inbox(self) -> None:
        assert self.transport is not None
        while True:
            frames = await self.transport.recv()
            message = codec.decode(frames[0], self.secret)
            if isinstance(message, codec.DecodeError):
                self._drops.note(f"{message.reason} ({message.detail})")
            elif len(frames) != (2 if isinstance(message, Relay) else 1):  # a Relay's second frame is its message
                self._drops.note(f"{type(message).__name__} in {len(frames)} frames")
            elif self.link.stale(getattr(message, "term", 0)):
                self._drops.note(f"stale_term ({type(message).__name__} of term {getattr(message, 'term', 0)})")
            elif isinstance(message, Welcome):
                self.welcomed = self.ever_welcomed = True
                self.last_contact = time.monotonic()
                if message.term:
                    self.link.follow(message.term, self.link.active, message.standby)
            elif isinstance(message, Coordinators):
                self._follow(message)
            elif isinstance(message, SilenceQuery):
                # Never answered yet (the job is starting): no silence to confirm.
                silent = time.monotonic() - self.last_contact if self.ever_welcomed else 0.0
                report = SilenceReport(self.agent_id, message.nonce, silent, self.link.term)
                with contextlib.suppress(TransportError):
                    await self.transport.send(message.reply_to, [codec.encode(report, self.secret)], 1.0)
            elif isinstance(message, StartStandby):
                print(f"deadpool: starting a standby coordinator here: {message.reason}", file=sys.stderr, flush=True)
                self._keep(self._start_standby())
            elif isinstance(message, Relay):
                self._keep(self._pass_on(message, frames[1]))
            elif isinstance(message, PrepareAck):
                if not self.acks.add(message):
                    self._drops.note(f"answer of {message.sender}, not a worker of this host")
                elif not self.acks.scheduled:
                    self.acks.scheduled = True
                    self._keep(self._send_acks())
            elif isinstance(message, Heartbeat):
                if not self.relay.heard(message):
                    self._drops.note(f"heartbeat of {message.sender}, not a worker of this host")
                elif self._preempt and message.step >= self._preempt[0].step:
                    self._preempted(self._preempt.pop(0))
            elif isinstance(message, FenceKill):
                self.relay.forget(message.member)
                self._fence_kill(message.member)
            elif isinstance(message, SignalMember):
                self._signal(message.member, message.action)
            elif isinstance(message, MoveResult):
                if self.drain is None or not self.drain.answered(message):
                    self._drops.note("a MoveResult for no drain of this host")
            elif isinstance(message, Stop):
                self.stop = message
                self.stop_event.set()
                if not message.ok:
                    print(f"deadpool: job stopped: {message.reason}", file=sys.stderr, flush=True)
            else:
                self._drops.note(f"unexpected {type(message).__name__}")

    def _write_job_file(self) -> None:
        info = jobfile.JobInfo(self.link.active, self.secret.decode(), self.events_path, os.getpid(),
                               [self.link.standby] if self.link.standby else [])
        self.job_file = jobfile.publish(info, self.agent_id) or self.job_file

    def _follow(self, message: Coordinators) -> None:
        """A new standby, or a newer term whose coordinator took over: talk to it from now on."""
        known = (self.link.active, self.link.standby)
        moved = self.link.follow(message.term, message.active, message.standby)
        if self.job_file is not None and (self.link.active, self.link.standby) != known:
            self._write_job_file()
        if moved:
            self.last_contact = time.monotonic()  # the new active has just spoken to us
            self.welcomed = False  # hello at once: the new active learns this host's processes
            print(f"deadpool: following the coordinator of term {message.term} at {message.active}",
                  file=sys.stderr, flush=True)

    def targets(self, specs: list[str]) -> dict[str, str]:
        """The member each of this host's `specs` (as ``str(ChaosSpec)`` writes them) was for: the one started in
        that seat, or as that spare."""
        found = {}
        for text in specs:
            spec = parse_chaos(text)
            for local, worker in enumerate(self.workers):
                spare = local - self.args.nproc if worker.role == "spare" else -1
                if applies(spec, worker.seat_hint, spare):
                    found[text] = worker.member
        return found

    def _preempted(self, spec: ChaosSpec) -> None:
        """A ``preempt`` spec's step came: SIGTERM to this launcher, a real preemption notice."""
        events = EventLog(self.events_path, member=self.agent_id, source="agent")
        try:
            events.emit(schema.ChaosInjected(action=ChaosAction.PREEMPT, spec=str(spec), target_member=self.agent_id))
        finally:
            events.close()
        os.kill(os.getpid(), signal.SIGTERM)

    def _signal(self, member: str, action: str) -> None:
        """Operator chaos: a real signal to one of this host's workers."""
        try:
            signum = SIGNALS[ChaosAction(action)]
        except (ValueError, KeyError):
            log.warning("dropped a chaos signal for %s: %r is not one of %s", member, action, ", ".join(SIGNALS))
            return
        for worker in self.workers:
            if worker.member == member and worker.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signum)

    def _fence_kill(self, member: str) -> None:
        for worker in self.workers:
            if worker.member == member and worker.returncode is None:
                exits.kill_group(worker.proc.pid)

    async def _watch(self, worker: Worker) -> None:
        """Report a worker's exit to the coordinator at once: the fastest failure signal."""
        # Not proc.wait(): it also waits for the output pipe to close, and a child of the worker that
        # inherited it (a DataLoader worker) holds it for seconds after the worker was killed.
        code = await exits.ended(worker.proc.pid)
        while code is None and (code := worker.proc.returncode) is None:  # the child watcher reaps it soon
            await asyncio.sleep(0.002)
        worker.returncode = code
        self.relay.forget(worker.member)
        try:
            if self.transport is None or self.stop is not None or self.coordinator_gone:
                # The job has ended: nobody needs the report, and a send to a coordinator that has exited
                # would hold the launcher's exit for the whole send timeout.
                return
            # The report first, the clean-up after: the exit is the fastest failure signal there is.
            await self._announce(only_new=True)  # spares started since the last hello: the coordinator waits for them
            with contextlib.suppress(TransportError):
                await self.transport.send(
                    self.link.active,
                    [codec.encode(ProcessExited(self.agent_id, worker.member, code, worker.seat_hint), self.secret)],
                    2.0)
        finally:
            exits.kill_group(worker.proc.pid)  # its children (DataLoader workers) would hold its sockets and pipe on
            self._remove_shm_files(worker)

    def _remove_shm_files(self, worker: Worker) -> None:
        """An exited worker's snapshot slot files go; a buddy that mapped one keeps its mapping."""
        try:
            shm.remove_files(self.shm_dir, worker.member, worker.proc.pid)
        except OSError as err:
            print(f"deadpool: could not remove {worker.label}'s snapshot files in {self.shm_dir}: {err}",
                  file=sys.stderr, flush=True)

    async def _terminate_all(self) -> None:
        """SIGTERM to every worker, SIGKILL to what is left of its session after 3 s: its children too (a
        DataLoader worker stuck where it cannot see its parent die would hold the output pipe for ever)."""
        alive = [w for w in self.workers if w.proc.returncode is None]
        for worker in alive:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for worker in alive:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(exits.ended(worker.proc.pid), max(0.1, deadline - time.monotonic()))
        for worker in alive:
            exits.kill_group(worker.proc.pid)
        for worker in alive:
            await exits.ended(worker.proc.pid)  # SIGKILL (and SIGCONT, for a stopped one) cannot be ignored


async def _awaited(task: asyncio.Task[None]) -> None:
    """`task`, started before a task group, awaited inside it (its failure ends the group, its cancel ends it)."""
    await task


def run(args: argparse.Namespace) -> int:
    """Entry point of ``deadpool launch``; returns the process exit code."""
    validate(args)
    raise_priority()
    if getattr(args, "check_determinism", False):
        return determinism.check(args, visible_steps(args.script_args), launch_in_child)
    return launch_once(args)[0]


def launch_in_child(args: argparse.Namespace) -> tuple[int, str]:
    """`launch_once` in a fresh interpreter (one per --check-determinism run: nothing carried over)."""
    child = ("import argparse, json, sys\nfrom deadpool.agent.launch import launch_once\n"
             "sys.exit(launch_once(argparse.Namespace(**json.loads(sys.argv[1])))[0])")
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(vars(args))], check=False)
    return proc.returncode, args.events


def launch_once(args: argparse.Namespace) -> tuple[int, str]:
    """Run this host's part of one job to its end and print its summary; returns (exit status, events file).

    The status is the job's (0 finished, 1 failed, 128+N stopped by signal N), unless a finished job's chaos
    spec never fired (``verdict.NOT_FIRED_STATUS``) or, under ``--strict``, its final state is not guaranteed
    to be a failure-free run's (``verdict.NOT_GUARANTEED_STATUS``).
    """
    launcher = Launcher(args)
    code = asyncio.run(launcher.run())
    specs = host_specs(args.chaos, args.node_rank * args.nproc, args.nproc, args.spares)
    end = closing.read(launcher.events_path, specs, launcher.targets(specs))
    if end.not_fired:
        _record_not_fired(launcher, end.not_fired)
    status, why = verdict.exit_status(code, end.not_fired, end.untracked, getattr(args, "strict", False))
    headline = "training finished" if code == 0 else "job FAILED"
    if launcher.drained:
        headline = f"host {launcher.host} drained; the job goes on without it"
    print(f"deadpool: {headline} (events: {launcher.events_path})", flush=True)
    for line in end.lines:
        print(line, flush=True)
    if why:
        print(f"deadpool: {why}", file=sys.stderr, flush=True)
    return status, launcher.events_path


def _record_not_fired(launcher: Launcher, findings: list[ChaosNotFired]) -> None:
    """A ``chaos_not_fired`` event per spec of this host that never fired, written by this launcher."""
    events = EventLog(launcher.events_path, member=launcher.agent_id, source="agent")
    try:
        for finding in findings:
            events.emit(schema.ChaosNotFired(spec=finding.spec, at=finding.at, target_member=finding.member,
                        target_rank=finding.rank, last_step=finding.last_step, seen=list(finding.seen),
                        ended=finding.ended, why=finding.why))
    finally:
        events.close()
