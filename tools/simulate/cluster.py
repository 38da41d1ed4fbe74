"""The simulated job: its configuration, its members and host agents, and the failures it suffers.

Members and agents are small state machines that speak the real protocol: they
join, beat, answer ``Prepare`` with the snapshots they hold, adopt views,
restore, and exit when fenced.  They see the run only through :class:`World`,
which the simulation loop (``loop.py``) implements.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from deadpool.config import Config
from deadpool.errors import MisuseError
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    AckBatch,
    CommitView,
    Fenced,
    FenceKill,
    Heartbeat,
    HostHeartbeat,
    Message,
    Prepare,
    PrepareAck,
    Role,
    Stop,
    ViewChunk,
    ViewDelta,
    ViewRequest,
    Welcome,
)
from deadpool.protocol.transport import CONTROL_LIMITS
from deadpool.protocol.view import View


class FailureKind(enum.StrEnum):
    """How a simulated member fails."""

    CRASH = "crash"  # the process dies; its agent reports the exit, its ring neighbours' collective fails
    HANG = "hang"  # silent; killed by its agent on FenceKill
    ZOMBIE = "zombie"  # silent and unkillable; it wakes later and sends stale messages that must be rejected


class ProcessState(enum.StrEnum):
    """A simulated member's process."""

    RUNNING = "running"
    FROZEN = "frozen"  # a hang or a zombie, until it is killed or wakes
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated job: its size, its failures and its clocks (virtual seconds)."""

    members: int = 1024  # seats + spares
    failures: int = 4  # members that die during the run
    seed: int = 0  # everything random derives from this
    heartbeat_interval: float = 0.1  # 2.5x Config's default rate: the load the scale figures were measured at
    duration: float = 10.0  # failures fall before this; the run then goes on (bounded) until all are resolved
    aggregate: bool = False  # host agents batch their members' heartbeats (HeartbeatBatch)
    tick: float = 0.01  # virtual time step; coordinator.tick() runs once per tick
    spare_fraction: float = 0.05  # spares = max(1, round(members * spare_fraction))
    members_per_host: int = 8  # one host agent per this many members
    step_s: float = 1.0  # one training step, in virtual seconds
    restore_s: float = 0.1  # restore + group rebuild after adopting a view
    join_s: float = 0.5  # members join at random times in [0, join_s)
    steady_s: float = 1.0  # steady-state window measured before the first failure
    failure_timeout: float = 0.0  # 0: Config's default (2 s), or 5 heartbeat intervals if that is longer
    prepare_timeout: float = 10.0  # Config's default
    max_frame_bytes: int = CONTROL_LIMITS.max_frame_bytes  # members drop larger frames, as workers do

    @property
    def spares(self) -> int:
        return max(1, round(self.members * self.spare_fraction))

    @property
    def seats(self) -> int:
        return self.members - self.spares

    def coordinator_config(self) -> Config:
        """The coordinator's Config: defaults, with this run's heartbeat interval and timeouts."""
        timeout = self.failure_timeout or max(Config().failure_timeout, 5 * self.heartbeat_interval)
        return Config(heartbeat_interval=self.heartbeat_interval, failure_timeout=timeout,
                      prepare_timeout=self.prepare_timeout).validate()

    def validate(self) -> SimConfig:
        """Check the values for sense.

        Raises:
            MisuseError: a value is out of range, with the name of the setting.
        """
        if self.members < 3:
            raise MisuseError(f"members must be at least 3 (two seats and a spare), got {self.members}")
        if self.seats < 2:
            raise MisuseError(f"spare_fraction {self.spare_fraction} leaves fewer than two seats")
        if self.failures < 0 or self.failures > self.members:
            raise MisuseError(f"failures must be between 0 and members ({self.members}), got {self.failures}")
        for name in ("heartbeat_interval", "duration", "tick", "step_s", "restore_s", "join_s", "steady_s"):
            if not getattr(self, name) > 0:
                raise MisuseError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval < self.tick:
            raise MisuseError(f"heartbeat_interval ({self.heartbeat_interval}s) is shorter than a tick ({self.tick}s)")
        if self.members_per_host < 1 or self.max_frame_bytes < 1:
            raise MisuseError("members_per_host and max_frame_bytes must be at least 1")
        config = self.coordinator_config()  # raises MisuseError for inconsistent timeouts
        if self.duration < self.join_s + 0.5 + self.steady_s + config.failure_timeout:
            raise MisuseError(
                f"duration {self.duration}s leaves no room for failures: it must exceed join, steady window "
                f"and failure_timeout ({self.join_s + 0.5 + self.steady_s + config.failure_timeout:.1f}s)"
            )
        return self


@dataclass(slots=True)
class ViewInfo:
    """Lookups over one view, built once and shared by every member (a view is O(members))."""

    view: View
    seat_of: dict[str, int]
    spares: frozenset[str]
    wards: dict[int, list[int]]  # seat -> seats whose snapshot copies it keeps


def view_info(view: View) -> ViewInfo:
    wards: dict[int, list[int]] = {}
    for ward, buddy in enumerate(view.buddies):
        if ward != buddy:
            wards.setdefault(buddy, []).append(ward)
    return ViewInfo(view, {member: seat for seat, member in enumerate(view.seats)}, frozenset(view.spares), wards)


@dataclass(slots=True)
class Failure:
    """One scheduled failure; its victim is chosen when it fires."""

    kind: FailureKind
    at_tick: int  # when it may fire
    during_round: bool  # waits for a view change in progress (a second failure close to the first)
    deadline_tick: int  # a during_round failure fires by then even without a view change
    spare: bool  # strike a spare
    member: str = ""  # the victim, once fired
    fired_tick: int = -1
    on_spare: bool = False  # the victim sat in no seat (a spare): resolved by a pool view, not by a swap


class World(Protocol):
    """What a simulated member or agent sees of the run (implemented by the simulation loop)."""

    @property
    def tick(self) -> int:
        """The current tick."""

    @property
    def stall_tick(self) -> int | None:
        """From this tick a stopped seated member blocks everyone's collectives (None: nobody is stopped)."""

    @property
    def step_ticks(self) -> int:
        """Ticks per training step."""

    @property
    def restore_ticks(self) -> int:
        """Ticks a restore and group rebuild take."""

    def send(self, message: Message) -> None:
        """Send to the coordinator (handled in this tick)."""

    def answer(self, member: SimMember, ack: PrepareAck) -> None:
        """`member` answers a Prepare: through its host agent (one AckBatch per host), or directly."""

    def view_info(self, view: View) -> ViewInfo:
        """The shared lookups over `view`."""

    def apply_delta(self, held: ViewInfo, delta: ViewDelta) -> ViewInfo | None:
        """The view `delta` makes from the one held (shared by every member holding it); None: another base."""

    def chunked_view(self, last: ViewChunk) -> ViewInfo:
        """The whole view of which a member now holds every piece (`last` is the final one)."""

    def adopted(self, info: ViewInfo) -> None:
        """A member adopted `info` (the first to adopt a newer view starts the group's rebuild)."""

    def stop_member(self, member: SimMember, state: ProcessState, returncode: int | None, delay: int = 1) -> None:
        """The member's process stops (dies or freezes); its agent reports an exit after `delay` ticks."""

    def fence_kill(self, member_id: str) -> None:
        """The agent kills the member (no effect on an unkillable zombie)."""


class SimMember:
    """One simulated worker: what the runtime does, reduced to the protocol and a step counter."""

    __slots__ = (
        "agent", "bulk_addr", "control_addr", "hb_frame", "hb_key", "hb_obj", "host", "member", "paused_step",
        "pid", "pieces", "prep_acked", "restore_base", "role", "run_from", "run_step", "seat", "seat_hint", "state",
        "swap_reported", "view", "welcomed",
    )

    def __init__(self, member: str, host: str, role: Role, seat_hint: int, pid: int, bulk_addr: str,
                 agent: SimAgent) -> None:
        self.member, self.host, self.role, self.seat_hint, self.pid = member, host, role, seat_hint, pid
        self.control_addr = f"inproc://sim-member/{member}"
        self.bulk_addr = bulk_addr
        self.agent = agent
        self.state = ProcessState.RUNNING
        self.welcomed = False
        self.view: ViewInfo | None = None
        self.seat: int | None = None
        self.run_step = -1  # the step the live state holds when run_from is reached
        self.run_from = 0  # tick from which steps finish again (after a restore)
        self.restore_base = -1  # resume step of the last restore: no older snapshot survives it
        self.paused_step: int | None = None  # frozen step while a view change is in progress
        self.prep_acked = 0  # highest Prepare epoch answered
        self.swap_reported = False  # a spare reported its first step in a seat (Recovered)
        self.hb_key: tuple[int, int] = (-1, -2)
        self.hb_obj: Heartbeat | None = None
        self.hb_frame = b""
        self.pieces: tuple[tuple[int, bytes], int] = ((0, b""), 0)  # (epoch, digest) of a chunked view, pieces got

    @property
    def running(self) -> bool:
        return self.state == ProcessState.RUNNING

    def step(self, world: World) -> int:
        """Last finished step: one per step_s, none while paused or while a stopped peer blocks the group."""
        if self.seat is None or self.view is None:
            return -1
        if self.paused_step is not None:
            return self.paused_step
        end = world.tick if world.stall_tick is None else min(world.tick, world.stall_tick)
        if end <= self.run_from:
            return self.run_step
        return self.run_step + (end - self.run_from) // world.step_ticks

    def heartbeat(self, world: World) -> Heartbeat:
        """This member's heartbeat now; object and frame reused while nothing in it changed."""
        epoch = self.view.view.epoch if self.view else 0
        step = self.step(world)
        if self.hb_obj is None or self.hb_key != (epoch, step):
            seated = self.seat is not None
            snapshot = step if seated else -2
            confirmed = max(self.restore_base, step - 1) if seated else -2
            self.hb_key, self.hb_obj = (epoch, step), Heartbeat(self.member, epoch, step, snapshot, confirmed, 0.0,
                                                                self.control_addr)
            self.hb_frame = codec.encode(self.hb_obj)
        return self.hb_obj

    def receive(self, message: Message, world: World) -> None:
        """A message from the coordinator, handled as the membership actor and the runtime do."""
        held = self.view.view.epoch if self.view else 0
        if isinstance(message, Welcome):
            self.welcomed = True
        elif isinstance(message, CommitView):
            if message.view.epoch > held:
                self._adopt(world.view_info(message.view), world)
        elif isinstance(message, ViewDelta):
            if message.epoch > held:
                info = world.apply_delta(self.view, message) if self.view is not None else None
                if info is None:
                    world.send(ViewRequest(self.member, held))  # missed its base: ask for the whole view
                else:
                    self._adopt(info, world)
        elif isinstance(message, ViewChunk):
            if message.epoch > held:
                key = (message.epoch, message.digest)
                got = self.pieces[1] + 1 if self.pieces[0] == key else 1
                self.pieces = (key, got)
                if got == message.count:
                    self._adopt(world.chunked_view(message), world)
        elif isinstance(message, Prepare):
            # Only a seated member holding a view answers; one waiting for its first view ignores it.
            if self.seat is not None and message.epoch > held and message.epoch > self.prep_acked:
                if self.paused_step is not None and not message.reanswer:
                    self.prep_acked = message.epoch  # its answer to an earlier Prepare of this round still counts
                    return
                if self.paused_step is None:
                    self.paused_step = self.step(world)
                self.prep_acked = message.epoch
                world.answer(self, self._ack(message.epoch))
        elif isinstance(message, Fenced):
            world.stop_member(self, ProcessState.DEAD, returncode=1)  # a fenced member exits touching nothing
        elif isinstance(message, Stop):
            world.stop_member(self, ProcessState.DEAD, returncode=None)

    def _adopt(self, info: ViewInfo, world: World) -> None:
        seat = info.seat_of.get(self.member)
        if seat is None and self.member not in info.spares:
            world.stop_member(self, ProcessState.DEAD, returncode=1)  # left out of the view: exits as fenced
            return
        rebuild = self.view is None or info.view.store_prefix != self.view.view.store_prefix
        world.adopted(info)
        self.view, self.seat = info, seat
        if seat is not None and rebuild:
            self.run_step = self.restore_base = info.view.resume_step
            self.run_from = world.tick + world.restore_ticks
            self.paused_step = None

    def _ack(self, epoch: int) -> PrepareAck:
        """The snapshots held: the last two local steps, and each ward's copies one step behind."""
        assert self.view is not None and self.seat is not None and self.paused_step is not None
        step, base = self.paused_step, self.restore_base
        local = sorted({max(base, step - 1), step})
        copies = sorted({max(base, step - 2), max(base, step - 1)})
        wards = {ward: list(copies) for ward in self.view.wards.get(self.seat, [])}
        return PrepareAck(self.member, epoch, step, local, wards)


class SimAgent:
    """One host's launcher: registers its workers, reports exits, fences by kill, batches heartbeats and answers."""

    __slots__ = ("acks", "agent_id", "batch_frame", "batch_key", "control_addr", "host", "members")

    def __init__(self, agent_id: str, host: str) -> None:
        self.agent_id, self.host = agent_id, host
        self.control_addr = f"inproc://sim-agent/{host}"
        self.members: list[SimMember] = []
        self.acks: list[PrepareAck] = []  # its members' answers to a Prepare, not sent yet
        self.batch_key: list[Heartbeat] = []
        self.batch_frame = b""

    def batch(self, world: World) -> bytes:
        """The HostHeartbeat frame for this interval: only members that beat since the last one ("" if none)."""
        beats = [m.heartbeat(world) for m in self.members if m.running and m.welcomed]
        if not beats:
            return b""
        if len(beats) != len(self.batch_key) or any(a is not b for a, b in zip(beats, self.batch_key, strict=True)):
            self.batch_key = beats
            self.batch_frame = codec.encode(HostHeartbeat(
                self.agent_id, [b.sender for b in beats], [b.epoch for b in beats], [b.step for b in beats],
                [b.snapshot_step for b in beats], [b.confirmed_step for b in beats],
                [b.control_addr for b in beats], [b.stall_p99_s for b in beats]))
        return self.batch_frame

    def answers(self) -> AckBatch | None:
        """The answers its members gave since the last call, as one message (None: none)."""
        acks, self.acks = self.acks, []
        return AckBatch.of(self.agent_id, acks) if acks else None

    def receive(self, message: Message, world: World) -> None:
        if isinstance(message, FenceKill):
            world.fence_kill(message.member)
        # Welcome and Stop need nothing from a simulated agent.
