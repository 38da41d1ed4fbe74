"""One process of the swarm benchmark (``bench/swarm.py``): simulated hosts on real ZeroMQ sockets, in wall-clock time.

The members and host agents are the simulator's state machines (``tools/simulate/cluster.py``): they
join, are welcomed, beat through their host agent (one ``HostHeartbeat`` per host and interval),
answer ``Prepare`` with ``PrepareAck``, adopt views (whole, as a delta or in pieces) and exit when
fenced. This module is the :class:`~deadpool.tools.simulate.cluster.World` they see, built on real
sockets instead of a virtual loop: every member binds its own ZeroMQ PULL socket (its control
address, as a worker does) and so does every host agent (it passes the coordinator's relayed
broadcasts to its members in process), everything this process sends to the coordinator leaves
through one ``ZmqTransport``, every frame is authenticated with the job's secret, and a tick is 10
ms of the wall clock shared by every swarm process. The orchestrator drives a process through JSON
lines on stdin (``go``, ``kill``, ``release``, ``status``, ``stop``) and reads its answers on
stdout. Steps follow one job-wide clock: a kill stalls every process at the same tick (a seat is
gone, the collectives block), and after a view that rebuilds the group no seat steps until the
orchestrator has seen every member hold it (``release``: the workers' adoption barrier).

Run by the orchestrator as ``python bench/swarm_world.py SPEC_JSON``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402
from deadpool.tools.simulate.cluster import (  # noqa: E402
    ProcessState,
    SimAgent,
    SimMember,
    ViewInfo,
    view_info,
)
from deadpool.transports.zmq_transport import ZmqTransport, shared_context  # noqa: E402

from deadpool.agent.relay import ACK_WINDOW_S, HELLO_EVERY_S  # noqa: E402
from deadpool.protocol import codec, viewsync  # noqa: E402
from deadpool.protocol.messages import (  # noqa: E402
    AgentHello,
    CommitView,
    FenceKill,
    Join,
    Message,
    Prepare,
    PrepareAck,
    ProcessExited,
    Recovered,
    Relay,
    Role,
    Stop,
    ViewChunk,
    ViewDelta,
    Welcome,
)
from deadpool.protocol.transport import AGENT_LIMITS, CONTROL_LIMITS, Limits, TransportError, new_event_loop  # noqa: E402
from deadpool.protocol.view import View  # noqa: E402

SEND_TIMEOUT_S = 2.0  # Config.send_timeout
CACHED_FRAMES = 8  # broadcast frames remembered, so that N identical copies decode once per process
BROADCASTS = (Prepare, CommitView, ViewDelta, ViewChunk, Stop)  # one encoded frame sent to many members
BARRIER = 1 << 62  # run_from of a seat waiting at the adoption barrier: no step finishes until it is released


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every member of the swarm lives: deterministic from the sizes and the seed."""

    members: int  # seats + spares
    seats: int  # the job's world size
    members_per_host: int  # one host agent per this many members
    procs: int  # swarm processes the hosts are split over
    seed: int  # member ids derive from this

    @property
    def hosts(self) -> int:
        return -(-self.members // self.members_per_host)

    def host_range(self, proc: int) -> range:
        """The hosts swarm process `proc` simulates (contiguous, as even as the count allows)."""
        return range(proc * self.hosts // self.procs, (proc + 1) * self.hosts // self.procs)

    def proc_of_host(self, host: int) -> int:
        return next(p for p in range(self.procs) if host in self.host_range(p))

    def member_ids(self) -> list[str]:
        """Member ids by index: seats first, spares last (as the simulator lays a job out)."""
        rng = random.Random(self.seed)
        ids = []
        for index in range(self.members):
            label = f"rank{index}" if index < self.seats else f"spare{index - self.seats}"
            ids.append(f"node{index // self.members_per_host:05d}:{label}:{rng.getrandbits(24):06x}")
        return ids


def layout_from(spec: dict[str, Any]) -> Layout:
    return Layout(spec["members"], spec["seats"], spec["members_per_host"], spec["procs"], spec["seed"])


class SwarmWorld:
    """The World of this process's members and agents: real sockets, the wall clock, the job's secret."""

    def __init__(self, spec: dict[str, Any], secret: bytes | None) -> None:
        self.spec = spec
        self.layout = layout_from(spec)
        self._secret = secret
        self._coordinator: str = spec["coordinator"]
        self._t0: float = spec["t0"]  # wall-clock origin of the ticks, the same in every swarm process
        self._tick_s: float = spec["tick"]
        self.step_ticks = max(1, round(spec["step_s"] / self._tick_s))
        self.restore_ticks = max(1, round(spec["restore_s"] / self._tick_s))
        self._hb_ticks = max(1, round(spec["heartbeat_interval"] / self._tick_s))
        self._hello_ticks = max(1, round(HELLO_EVERY_S / self._tick_s))
        self._stall: int | None = None
        self._loop = asyncio.get_running_loop()
        self._rng = random.Random(spec["seed"] * 1000 + spec["proc"])
        # What the members share (a view is O(members): one copy per process, as the simulator keeps one).
        self._infos: dict[int, ViewInfo] = {}
        self._deltas: dict[tuple[int, bytes], ViewInfo | None] = {}
        self._digests: dict[int, tuple[View, bytes]] = {}
        self._assembly: dict[bytes, viewsync.Reassembly] = {}
        self._pieces: dict[bytes, View] = {}
        self._current: ViewInfo | None = None
        self._released: dict[int, int] = {}  # epoch -> tick its adoption barrier opened (every seat adopted)
        self._rebuilds: set[int] = set()  # epochs that rebuilt a running job's group (their first step is reported)
        self._recent: deque[tuple[bytes, Message]] = deque(maxlen=CACHED_FRAMES)  # (frame key, decoded)
        # What this process measured and checked, reported to the orchestrator.
        self.view_digests: dict[int, str] = {}  # epoch -> digest of every view (whole, delta, piece) received
        self.adoptions: dict[int, list[float]] = {}  # epoch -> [members that adopted it, first, last wall time]
        self.prepares: dict[int, list[float]] = {}  # epoch -> [members that got its Prepare, first, last wall time]
        self.violations: list[str] = []
        self.lag_max_s = 0.0  # the longest the heartbeat loop ran late (the process starved, or busy)
        self.queued_max = 0  # the most frames waiting to be sent to the coordinator (back-pressure)
        self.counts = {"sent": 0, "received": 0, "decoded": 0, "rejected": 0, "send_failed": 0, "recovered": 0,
                       "relayed": 0}
        # Members, agents and sockets.
        self.transport = ZmqTransport("tcp://127.0.0.1:0", CONTROL_LIMITS)  # what this process sends
        self._zmq: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(shared_context().underlying)  # plain sockets
        self.members: list[SimMember] = []
        self.agents: list[SimAgent] = []
        self._by_id: dict[str, SimMember] = {}
        self._agent_by_id: dict[str, SimAgent] = {}
        self._by_addr: dict[str, SimMember] = {}  # control address -> member, for relays
        self._agent_sockets: list[zmq.Socket[bytes]] = []
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._signed: dict[str, tuple[bytes, bytes]] = {}  # agent -> (its unsigned batch frame, signed)
        self._out: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []  # owned by _amain's TaskGroup; cancelled at close
        self._build()

    # -- set up ---------------------------------------------------------------------------------

    def _build(self) -> None:
        layout, spec = self.layout, self.spec
        ids = layout.member_ids()
        hosts = layout.host_range(spec["proc"])
        for h in hosts:
            host = f"node{h:05d}"
            agent = SimAgent(f"agent-{host}", host)
            self._listen_agent(agent)  # its own control socket, as each host's agent has
            self.agents.append(agent)
            self._agent_by_id[agent.agent_id] = agent
            for index in range(h * layout.members_per_host, min((h + 1) * layout.members_per_host, layout.members)):
                seated = index < layout.seats
                member = SimMember(ids[index], host, Role.ACTIVE if seated else Role.SPARE, index if seated else -1,
                                   10_000 + index, f"tcp://127.0.0.1:{20_000 + index % 40_000}", agent)
                self._listen(member)
                agent.members.append(member)
                self.members.append(member)
                self._by_id[member.member] = member

    def _pull(self, limits: Limits) -> tuple[zmq.Socket[bytes], str]:
        """A control socket of its own, configured as a transport with `limits` configures its PULL socket."""
        sock: zmq.Socket[bytes] = self._zmq.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, limits.inbox_size)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        sock.bind("tcp://127.0.0.1:*")
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _listen(self, member: SimMember) -> None:
        """The member's own control socket, as a worker's."""
        sock, member.control_addr = self._pull(CONTROL_LIMITS)
        self._by_addr[member.control_addr] = member
        self._sockets[member.member] = sock
        self._loop.add_reader(sock.fileno(), self._readable, member, sock)

    def _listen_agent(self, agent: SimAgent) -> None:
        """The agent's own control socket, as an agent's (AGENT_LIMITS: a relay is 2 frames)."""
        sock, agent.control_addr = self._pull(AGENT_LIMITS)
        self._agent_sockets.append(sock)
        self._loop.add_reader(sock.fileno(), self._agent_readable, sock)

    def _unlisten(self, member: SimMember, close: bool) -> None:
        """A stopped process reads nothing; a dead one's socket is gone (the coordinator's sends to it wait)."""
        sock = self._sockets.get(member.member)
        if sock is None or sock.closed:
            return
        self._loop.remove_reader(sock.fileno())
        if close:
            sock.close(linger=0)

    # -- the World ------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        return int((time.time() - self._t0) / self._tick_s)

    def tick_of(self, wall: float) -> int:
        return int((wall - self._t0) / self._tick_s)

    @property
    def stall_tick(self) -> int | None:
        return self._stall

    def send(self, message: Message) -> None:
        self._queue(codec.encode(message, self._secret))

    def answer(self, member: SimMember, ack: PrepareAck) -> None:
        """As an agent's AckBatcher (deadpool/agent/relay.py): the first answer waits for its host's others."""
        agent = member.agent
        if not agent.acks:
            self._loop.call_later(ACK_WINDOW_S, self._send_answers, agent)
        agent.acks.append(ack)

    def _send_answers(self, agent: SimAgent) -> None:
        batch = agent.answers()
        if batch is not None:
            self.send(batch)

    def view_info(self, view: View) -> ViewInfo:
        """One ViewInfo per committed view in this process, however it arrived (whole, delta, pieces)."""
        info = self._infos.get(view.epoch)
        if info is not None and (info.view is view or self._digest(info.view) == self._digest(view)):
            return info
        info = self._infos[view.epoch] = view_info(view)
        return info

    def apply_delta(self, held: ViewInfo, delta: ViewDelta) -> ViewInfo | None:
        key = (id(held.view), delta.digest)
        if key not in self._deltas:
            view, _ = viewsync.apply_delta(held.view, self._digest(held.view), delta)
            self._deltas[key] = None if view is None else self.view_info(view)
        return self._deltas[key]

    def chunked_view(self, last: ViewChunk) -> ViewInfo:
        return self.view_info(self._pieces[last.digest])  # reassembled as the pieces arrived (_note_view)

    def adopted(self, info: ViewInfo) -> None:
        now = time.time()
        record = self.adoptions.setdefault(info.view.epoch, [0, now, now])
        record[0] += 1
        record[2] = now
        if self._current is None or info.view.epoch > self._current.view.epoch:
            previous, self._current = self._current, info
            if previous is not None and previous.view.store_prefix != info.view.store_prefix:
                self._stall = None  # the rebuilt group runs again once every seat adopted (release)
                self._rebuilds.add(info.view.epoch)

    def stop_member(self, member: SimMember, state: ProcessState, returncode: int | None, delay: int = 1) -> None:
        """The member's process stops; a dead one's agent reports the exit (after `delay` ticks)."""
        if member.state == ProcessState.DEAD or member.state == state:
            return
        was_running = member.running
        member.state = state
        self._unlisten(member, close=state == ProcessState.DEAD)
        current = self._current
        if was_running and current is not None and member.member in current.seat_of and self._stall is None:
            self._stall = self.tick
        if returncode is not None:
            exited = ProcessExited(member.agent.agent_id, member.member, returncode, member.seat_hint)
            self._loop.call_later(delay * self._tick_s, self.send, exited)

    def fence_kill(self, member_id: str) -> None:
        member = self._by_id.get(member_id)
        if member is not None and member.state != ProcessState.DEAD:
            self.stop_member(member, ProcessState.DEAD, returncode=-9)

    # -- helpers of the World -------------------------------------------------------------------

    def _digest(self, view: View) -> bytes:
        cached = self._digests.get(id(view))
        if cached is None or cached[0] is not view:
            cached = self._digests[id(view)] = (view, viewsync.view_digest(view))
        return cached[1]

    def _recovered(self, info: ViewInfo) -> None:
        """Every seat that finished its first step under the rebuilt view reports it, as a worker does."""
        if self._current is not info:
            return
        resume = info.view.resume_step
        for member in self.members:
            if member.running and member.view is info and member.seat is not None and member.step(self) > resume:
                self.send(Recovered(member.member, info.view.epoch, resume + 1, time.time()))
                self.counts["recovered"] += 1

    def _queue(self, frame: bytes) -> None:
        self._out.append(frame)
        self.queued_max = max(self.queued_max, len(self._out))
        self._wake.set()

    def _sign(self, plain: bytes) -> bytes:
        """`plain` (encoded without a secret, as SimAgent.batch does) as codec.encode(..., secret) encodes it."""
        if not self._secret:
            return plain
        body = plain[:3] + bytes((codec.FLAG_HMAC,)) + plain[4:]
        return body + hmac.digest(self._secret, body, "sha256")

    def _note_view(self, message: Message) -> None:
        """Each distinct view frame once: its digest per epoch (one view per epoch), pieces reassembled."""
        if isinstance(message, ViewDelta | ViewChunk):
            epoch, digest = message.epoch, message.digest
        elif isinstance(message, CommitView):
            epoch, digest = message.view.epoch, self._digest(message.view)
        else:
            return
        held = self.view_digests.setdefault(epoch, digest.hex())
        if held != digest.hex():
            self.violations.append(f"two different views received for epoch {epoch}")
        if isinstance(message, ViewChunk) and message.digest not in self._pieces:
            view, why = self._assembly.setdefault(message.digest, viewsync.Reassembly()).add(message)
            if view is not None:
                self._pieces[message.digest] = view
            elif why:
                self.violations.append(f"bad piece of view {message.epoch}: {why}")

    def _decode(self, frame: memoryview) -> Message | None:
        """The message in `frame`; a broadcast's N identical copies are decoded (and checked) once.

        A copy is recognized by its length and its HMAC (a different frame under the same MAC would
        be a forgery), so a whole view sent to thousands of members is not compared byte by byte.
        """
        key = self._key(frame)
        for seen, message in self._recent:
            if seen == key:
                return message
        decoded = codec.decode(frame, self._secret, CONTROL_LIMITS.max_frame_bytes)
        self.counts["decoded"] += 1
        if isinstance(decoded, codec.DecodeError):
            self.counts["rejected"] += 1
            return None
        self._note_view(decoded)
        if isinstance(decoded, BROADCASTS):  # the same frame goes to many members; a Welcome or Fenced to one
            self._recent.appendleft((key, decoded))
        return decoded

    def _key(self, frame: memoryview) -> bytes:
        """What identifies a frame: its MAC and length where frames are authenticated, else all of it."""
        if self._secret and len(frame) > codec.MAC_BYTES:
            return len(frame).to_bytes(4, "big") + bytes(frame[-codec.MAC_BYTES:])
        return bytes(frame)

    # -- I/O --------------------------------------------------------------------------------------

    def _readable(self, member: SimMember, sock: zmq.Socket[bytes]) -> None:
        """Drain the member's socket (ZMQ_FD signals edges: read until EAGAIN)."""
        while member.running:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)  # no copy into Python: a whole view is ~1 MB
            except zmq.Again:
                return
            self.counts["received"] += 1
            message = self._decode(frame.buffer)
            if message is not None:
                self._deliver(member, message)

    def _deliver(self, member: SimMember, message: Message) -> None:
        """A message from the coordinator reaches `member` (on its own socket, or through its agent)."""
        if isinstance(message, Prepare):
            now = time.time()
            record = self.prepares.setdefault(message.epoch, [0, now, now])
            record[0] += 1
            record[2] = now
        run_from = member.run_from
        member.receive(message, self)
        if member.run_from != run_from and member.view is not None:
            # It adopted a view that rebuilds its group: like a worker, it starts the next step only
            # when every seat has adopted (the adoption barrier, released by the orchestrator).
            member.run_from = self._released.get(member.view.view.epoch, BARRIER)

    async def send_loop(self) -> None:
        """Everything this process's members and agents send, in order, over the one transport."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._out:
                frame = self._out.popleft()
                try:
                    await self.transport.send(self._coordinator, [frame], SEND_TIMEOUT_S)
                    self.counts["sent"] += 1
                except TransportError:
                    self.counts["send_failed"] += 1

    def _agent_readable(self, sock: zmq.Socket[bytes]) -> None:
        """Drain an agent's socket: welcomes, fence-kills, the job's stop, and broadcasts to relay."""
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [part.buffer for part in parts]
            message = codec.decode(frames[0], self._secret, AGENT_LIMITS.max_frame_bytes)
            self.counts["received"] += 1
            if isinstance(message, codec.DecodeError) or len(frames) != (2 if isinstance(message, Relay) else 1):
                self.counts["rejected"] += 1
            elif isinstance(message, Relay):
                # A real agent sends the frame on to each of its workers over its host's loopback
                # (deadpool/agent/relay.py). Here one process holds 256 hosts' agents and workers: the frame is
                # decoded once and handed to the members, or this one process would move every host's copies.
                self.counts["relayed"] += 1
                inner = self._decode(frames[1])
                for addr in message.to:
                    member = self._by_addr.get(addr)
                    if inner is not None and member is not None and member.running:
                        self._deliver(member, inner)
            elif isinstance(message, Welcome):
                agent = self._agent_by_id.get(message.member)
                if agent is not None:
                    agent.receive(message, self)
            elif isinstance(message, FenceKill):
                member = self._by_id.get(message.member)
                if member is not None:
                    member.agent.receive(message, self)
            elif isinstance(message, Stop):
                for agent in self.agents:
                    agent.receive(message, self)

    async def beat_loop(self) -> None:
        """Each agent's HostHeartbeat once per interval and its hello once a second, phases spread by tick."""
        beats: list[list[SimAgent]] = [[] for _ in range(self._hb_ticks)]
        hellos: list[list[SimAgent]] = [[] for _ in range(self._hello_ticks)]
        for agent in self.agents:
            beats[self._rng.randrange(self._hb_ticks)].append(agent)
            hellos[self._rng.randrange(self._hello_ticks)].append(agent)
        hello_frames = {a.agent_id: codec.encode(self._hello(a), self._secret) for a in self.agents}
        last = self.tick
        while True:
            await asyncio.sleep(self._tick_s - (time.time() - self._t0) % self._tick_s)
            now = self.tick
            self.lag_max_s = max(self.lag_max_s, (now - last - 1) * self._tick_s)  # this loop late by so much
            for tick in range(last + 1, now + 1):
                for agent in beats[tick % self._hb_ticks]:
                    plain = agent.batch(self)
                    if plain:
                        cached = self._signed.get(agent.agent_id)
                        if cached is None or cached[0] is not plain:
                            cached = self._signed[agent.agent_id] = (plain, self._sign(plain))
                        self._queue(cached[1])
                for agent in hellos[tick % self._hello_ticks]:
                    self._queue(hello_frames[agent.agent_id])
            last = now

    def _hello(self, agent: SimAgent) -> AgentHello:
        return AgentHello(agent.agent_id, agent.host, agent.control_addr, {m.member: m.pid for m in agent.members})

    def start(self) -> None:
        """Agents say hello, then members join at random times within join_s."""
        for agent in self.agents:
            self.send(self._hello(agent))
        join_s: float = self.spec["join_s"]
        seats = self.layout.seats
        for member in self.members:
            join = Join(member.member, member.role, member.seat_hint, seats, member.pid, member.host,
                        member.control_addr, member.bulk_addr)
            self._loop.call_later(self._rng.uniform(0, join_s), self._queue, codec.encode(join, self._secret))

    def kill(self, member_id: str, kind: str, at: float) -> None:
        """At wall time `at`: the job's collectives stall (a seat is gone); its own process stops the member."""
        current = self._current
        if current is not None and member_id in current.seat_of and self._stall is None:
            self._stall = self.tick_of(at)
        member = self._by_id.get(member_id)
        if member is None:
            return
        if kind == "crash":
            self.stop_member(member, ProcessState.DEAD, returncode=-9)
        else:
            self.stop_member(member, ProcessState.FROZEN, returncode=None)
        _reply({"killed": member_id, "kind": kind, "ts": time.time()})

    def release(self, epoch: int, at: float) -> None:
        """Every seat holds view `epoch`: the adoption barrier opens at wall time `at`, the job steps again."""
        start = self.tick_of(at) + self.restore_ticks  # the simulated restore and group rebuild
        self._released[epoch] = start
        info = self._infos.get(epoch)
        for member in self.members:
            if member.view is not None and member.view.view.epoch >= epoch and member.run_from == BARRIER:
                member.run_from = start
        if info is not None and epoch in self._rebuilds:
            delay = max(0.0, at - time.time()) + (self.restore_ticks + self.step_ticks + 1) * self._tick_s
            self._loop.call_later(delay, self._recovered, info)

    def status(self) -> dict[str, Any]:
        held: dict[int, int] = {}
        for member in self.members:
            if member.running:
                epoch = member.view.view.epoch if member.view else 0
                held[epoch] = held.get(epoch, 0) + 1
        cpu = os.times()
        return {
            "proc": self.spec["proc"],
            "running": sum(1 for m in self.members if m.running),
            "welcomed": sum(1 for m in self.members if m.welcomed),
            "held": held,
            "counts": dict(self.counts),
            "lag_max_s": round(self.lag_max_s, 3),
            "queued_max": self.queued_max,
            "cpu_s": round(cpu.user + cpu.system, 3),
        }

    def stats(self) -> dict[str, Any]:
        return {**self.status(), "adoptions": self.adoptions, "prepares": self.prepares,
                "view_digests": self.view_digests,
                "violations": self.violations}

    async def close(self) -> None:
        for member in self.members:
            self._unlisten(member, close=True)
        for sock in self._agent_sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close(linger=0)
        await self.transport.close()  # the last transport of the process terminates the shared context
        for task in self.tasks:
            task.cancel()


def _reply(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def _commands(world: SwarmWorld, tasks: asyncio.TaskGroup) -> None:
    """The orchestrator's commands, one JSON object per line on stdin, until ``stop`` (or stdin closes)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        match command["cmd"]:
            case "go":
                world.start()
                world.tasks.append(tasks.create_task(world.beat_loop()))
            case "kill":
                loop.call_later(max(0.0, command["at"] - time.time()), world.kill, command["member"],
                                command["kind"], command["at"])
            case "release":
                world.release(command["epoch"], command["at"])
            case "status":
                _reply({"status": world.status()})
            case "stop":
                break
    _reply({"stats": world.stats()})


async def _amain(spec: dict[str, Any]) -> None:
    secret = os.environ.get("DEADPOOL_SECRET", "").encode() or None
    world = SwarmWorld(spec, secret)
    _reply({"ready": {"proc": spec["proc"], "members": len(world.members), "agents": len(world.agents),
                      "endpoint": world.transport.address}})
    try:
        async with asyncio.TaskGroup() as tasks:
            world.tasks += [tasks.create_task(world.transport.run()), tasks.create_task(world.send_loop())]
            await _commands(world, tasks)
            await world.close()
    finally:
        await world.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    loop = new_event_loop()
    try:
        loop.run_until_complete(_amain(spec))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
