"""The one meeting point of the compute thread and the runtime thread.

Nothing else is shared between them.  The runtime thread (actors on an
asyncio loop) *delivers* commands and publishes snapshot bookkeeping; the
compute thread (the user's training loop) *takes* commands at step boundaries,
*waits* on conditions with bounds, and *posts* messages for the actors.  All
state below is guarded by one condition variable, which also serves as the
wake-up for collective waits (see ``collective.Waiter``), so a Prepare that
arrives while the compute thread is blocked in an all-reduce wakes it at once.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deadpool.actors.inbox import Drain
from deadpool.errors import WaitTimeout
from deadpool.protocol.messages import Audit, CommitView, Fenced, Hold, Leave, Prepare, RestorePart, Stop, Takeover
from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import Manifest

Command = Prepare | CommitView | Stop | Fenced | Takeover  # a Takeover only to a spare reserved for a move
MAX_COMMANDS = 64
MAX_AUDITS = 4  # audits a spare keeps asked of it (older ones drop out)
CHECKS_TOLD = 4  # the newest snapshots' replica checksums each heartbeat carries (Progress.checks)


TIMED_STEPS = 5  # a Leave is placed against the median of the last steps' times (``leave_step``)
LEAVE_MARGIN = 0.35  # ... and waits for the next step when the one in progress is this close (of a step) to its end


def leave_step(finished: int, elapsed: float, typical: float | None) -> tuple[int, str]:
    """The step a seat told to leave now leaves after, and why: the step in progress (the one after `finished`,
    begun `elapsed` seconds ago), or, when that step is expected to end within ``LEAVE_MARGIN`` of a `typical` step,
    the next one. The other seats are told to hold at the end of the step named; those a little ahead of this one
    (they end their steps at different times) would be told too late, begin the next step and abandon it."""
    if typical is None or typical <= 0:
        return finished + 1, "the step in progress (no step timed yet)"
    if elapsed < typical * (1 - LEAVE_MARGIN):
        return finished + 1, f"the step in progress ({elapsed:.3f} s into a {typical:.3f} s step)"
    return finished + 2, (f"the step after the one in progress ({elapsed:.3f} s into a {typical:.3f} s step, too "
                          "close to its end for every other seat to be told to hold in time)")


# -- what the compute thread posts for the actors (the handoff's vocabulary) -------------------------


@dataclass(frozen=True, slots=True)
class LocalReady:
    """The compute side finished copying a local snapshot."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class Fetched:
    """A part of a seat's snapshot, fetched from a peer."""

    step: int  # the step it is the state after
    manifest: Manifest  # the snapshot's layout
    frames: list[memoryview]  # the part's bytes


@dataclass(frozen=True, slots=True)
class Fetch:
    """The compute side asks for `part` of (seat, step)'s snapshot from `member` (a seat restoring)."""

    seat: int
    step: int
    member: str
    future: concurrent.futures.Future[Fetched]
    part: RestorePart = RestorePart.HELD
    newest: bool = False  # whatever step `member` holds newest (a spare's prefetch, before the step is known)
    finishing: bool = False  # `member` finishes `step` if it is still in it (``RestoreRequest.finishing``)


@dataclass(frozen=True, slots=True)
class PrepareReady:
    """The compute thread stopped for a Prepare: what it holds itself (the snapshot actor adds its ward copies)."""

    epoch: int  # the epoch being acknowledged
    step: int  # last finished step of the live state
    begun: int  # the last step it began: `step`, or the lost step after it (it issues no later collective)
    local_steps: list[int]  # complete local snapshots held
    disk_steps: list[int]  # steps with a complete disk checkpoint for every seat
    dirty_groups: list[str] = field(default_factory=list)  # mesh groups with a collective not completed here
    peers: list[str] = field(default_factory=list)  # members sharing a mesh group with this seat: told it paused
    abandoned: bool = False  # it stopped step `begun`'s backward before its first collective (``PeerPaused``)
    in_forward: bool = False  # it stopped step `begun` in its forward (``PeerPaused.in_forward``)


@dataclass
class Progress:
    """A worker's counters, for its heartbeats and its memory report: GIL-atomic fields, each with exactly
    one writer.

    The compute thread writes ``epoch``, ``step``, ``stall_p99_s``, ``compute_s`` and ``answers_early``; the
    snapshot actor writes ``snapshot_step``, ``confirmed_step``, ``checks`` and the byte counts; the others only read.
    """

    epoch: int = 0
    step: int = -1
    snapshot_step: int = -2
    confirmed_step: int = -2
    stall_p99_s: float = 0.0
    compute_s: float = 0.0  # median over recent steps of the step's time outside collective waits (slowness)
    # The compute thread: a Prepare may be answered before it stops (False with a mesh, whose PrepareAck must
    # list the groups the step left dirty, known only at the boundary).
    answers_early: bool = True
    bytes_sent: int = 0  # snapshot bytes streamed to the buddy so far
    bytes_held_for_wards: int = 0  # wards' copies held in memory of our own
    bytes_shared_for_wards: int = 0  # wards' copies held as mappings of their slot files (no memory of ours)
    # The newest snapshots' checksums of the replicated state, (epoch, step, checksum), oldest first: every
    # heartbeat carries them, so a check is not lost when two snapshots come within one heartbeat interval.
    checks: tuple[tuple[int, int, int], ...] = ()


class Handoff:
    """Thread-safe mailbox between the runtime (producer) and compute (consumer) threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.condition = threading.Condition()
        self._clock = clock  # times the steps (``leave_step``)
        self._commands: deque[tuple[Command, float]] = deque()  # with when each arrived (monotonic)
        self._prepare_epoch = 0  # newest epoch a Prepare asked for
        self._failure_epoch = 0  # ... and the newest of a Prepare that is not a planned move's
        self._failed: deque[tuple[int, frozenset[int]]] = deque(maxlen=MAX_COMMANDS)  # (epoch, failed seats)
        self._paused: dict[str, tuple[int, int, bool, bool]] = {}  # mesh peer -> (Prepare epoch, step begun,
        # abandoned, in its forward)
        self._terminal: Stop | Fenced | None = None  # a command after which nothing else matters
        self._leave: Leave | None = None  # a planned move asked this seat to leave ...
        self._leave_after = -1  # ... at the end of this step or the first after it (-1: its next boundary)
        self._began: float | None = None  # when the step in progress began (monotonic; None: between two steps)
        self._took: deque[float] = deque(maxlen=TIMED_STEPS)  # how long the last steps took, begin to end
        self._hold = -1  # a planned move elsewhere asks this seat to wait at the end of this step (-1: none)
        self._finished = -1  # the last step the compute thread ended (``at_boundary``)
        self._audits: deque[Audit] = deque(maxlen=MAX_AUDITS)  # audits asked of this spare, oldest first
        self._confirmed: set[tuple[str, int]] = set()  # (generation, step) copies confirmed by the buddy
        self._post: Callable[[Any], None] | None = None
        self._on_loss: Callable[[frozenset[int]], None] | None = None  # told a Prepare's failed seats at once
        self.dropped_commands = 0

    # -- runtime side -------------------------------------------------------------------------

    def bind(self, post: Callable[[Any], None] | None) -> None:
        """Install the runtime's thread-safe entry point (``loop.call_soon_threadsafe`` wrapper); None once the
        runtime thread has ended, so that later posts fail at once instead of waiting for nobody."""
        self._post = post

    def on_loss(self, callback: Callable[[frozenset[int]], None]) -> None:
        """Have `callback` told, on the runtime thread as each Prepare arrives, the seats it declares lost (none:
        any may be), before the compute thread sees it: the communicators holding them are aborted then, since
        a compute thread stuck behind a hung NCCL collective would see it only once they are."""
        self._on_loss = callback

    def deliver(self, command: Command) -> None:
        """Queue a command for the compute thread and wake it wherever it waits."""
        if isinstance(command, Prepare) and self._on_loss is not None:
            self._on_loss(frozenset(command.failed_seats))
        with self.condition:
            if isinstance(command, (Stop, Fenced)):
                self._terminal = command
            elif isinstance(command, Prepare):
                self._prepare_epoch = max(self._prepare_epoch, command.epoch)
                self._hold = -1  # this seat stops for it wherever it is
                self._leave_after = -1  # a seat moving leaves at the first boundary after the repair
                if not command.planned:
                    self._failure_epoch = max(self._failure_epoch, command.epoch)
                self._failed.append((command.epoch, frozenset(command.failed_seats)))
            if len(self._commands) >= MAX_COMMANDS:
                self._commands.popleft()  # the newest view supersedes the oldest; terminal state is kept above
                self.dropped_commands += 1
            self._commands.append((command, time.monotonic()))
            self.condition.notify_all()

    def peer_paused(self, member: str, prepare_epoch: int, begun: int, abandoned: bool = False,
                    in_forward: bool = False) -> None:
        """A mesh-group peer stopped for Prepare(`prepare_epoch`) after beginning step `begun` (``PeerPaused``),
        `abandoned`: with only that step's forward collectives issued (`in_forward`: not even all of those)."""
        with self.condition:
            if len(self._paused) >= 4 * MAX_COMMANDS and member not in self._paused:
                self._paused.clear()  # a bound: entries of long-past rounds are of no use
            self._paused[member] = (prepare_epoch, begun, abandoned, in_forward)
            self.condition.notify_all()

    def confirm(self, generation: str, step: int) -> None:
        """The buddy holds a complete copy of our snapshot of `step` (in group `generation`)."""
        with self.condition:
            self._confirmed.add((generation, step))
            if len(self._confirmed) > 8:
                self._confirmed = {item for item in self._confirmed if item[1] >= step - 4}
            self.condition.notify_all()

    def wake(self) -> None:
        with self.condition:
            self.condition.notify_all()

    # -- compute side -------------------------------------------------------------------------

    def post(self, message: Any) -> None:
        """Hand a message to the runtime thread (never blocks the compute thread).

        Raises:
            RuntimeError: the runtime thread is not running.
        """
        if self._post is None:
            raise RuntimeError("runtime thread is not running")
        self._post(message)

    def flush(self, timeout: float) -> bool:
        """Wait until every message posted before this call was handed to the transport.

        A marker goes the same way as the posts before it and is ordered after them (a PrepareReady's
        PrepareAck included); True once the runtime thread's membership actor reached it, False if that
        took longer than `timeout`.  For the compute thread only: on the runtime thread it would wait for
        itself.

        Raises:
            RuntimeError: the runtime thread is not running.
        """
        handed = threading.Event()
        self.post(Drain(handed.set))
        return handed.wait(timeout)

    def interrupted(self, epoch: int) -> bool:
        """True when the compute thread must stop its step: a newer view is being prepared, or the end."""
        return self._prepare_epoch > epoch or self._terminal is not None

    def step_lost(self, epoch: int) -> bool:
        """True when a step that ran to its end in view `epoch` without a failed collective is lost all the same: a
        Prepare for a failure arrived meanwhile (a planned move's does not lose it), or the end came."""
        return self._failure_epoch > epoch or self._terminal is not None

    def lost_any(self, epoch: int, seats: Sequence[int]) -> bool:
        """True when a Prepare newer than `epoch` declared one of `seats` dead (or named no seat: then any may
        be), or the end came: a mesh group's collective with such a seat cannot complete."""
        if self._terminal is not None:
            return True
        return any(newer > epoch and (not failed or not failed.isdisjoint(seats)) for newer, failed in self._failed)

    def peer_stopped_before(self, epoch: int, members: Sequence[str], step: int, past_forward: bool = False) -> bool:
        """True when one of `members` paused for a Prepare newer than `epoch` before reaching `step`, or, for a
        wait `past_forward` of its step, after abandoning that step's backward, or, for any wait of its step,
        after abandoning that step's forward: it will not issue the collective, so a wait on a group with it
        cannot complete.  (Every forward collective of a step abandoned in its backward was issued and waited
        on by the seat that abandoned it: a wait on one completes.)"""
        for member in members:
            paused = self._paused.get(member)
            if paused is not None and paused[0] > epoch and (
                    paused[1] < step or (paused[1] == step and paused[2] and (past_forward or paused[3]))):
                return True
        return False

    @property
    def terminal(self) -> Stop | Fenced | None:
        return self._terminal

    def request_leave(self, leave: Leave) -> tuple[int, str]:
        """The coordinator asked this seat to hand itself to a spare: returns the step it leaves after (the step in
        progress, or the next one when the step in progress is nearly over: ``leave_step``) and why (the compute
        thread checks at each step's end, ``at_boundary``)."""
        with self.condition:
            elapsed = self._clock() - self._began if self._began is not None else 0.0
            step, why = leave_step(self._finished, elapsed, statistics.median(self._took) if self._took else None)
            self._leave, self._leave_after = leave, step
            self.condition.notify_all()
            return step, why

    def request_hold(self, hold: Hold) -> int | None:
        """The coordinator asks this seat to wait at the end of `hold.step` for a move's view change. Returns None
        when it will (``at_boundary``), else the step the compute thread last ended: too late, it went on (it then
        pauses inside the next step, as for any view change)."""
        with self.condition:
            if hold.step <= self._finished:
                return self._finished
            if self._hold < 0 or hold.step < self._hold:
                self._hold = hold.step
            return None

    def begin_step(self, step: int) -> None:
        """The compute thread begins `step` (again, after an adoption that resumed before it)."""
        with self.condition:
            self._finished = step - 1
            self._began = self._clock()

    def at_boundary(self, step: int) -> tuple[Leave | None, bool]:
        """The compute thread ended `step`: the move this seat is to make now (None: none), and whether it is to
        hold here for a move elsewhere."""
        with self.condition:
            if self._began is not None:
                self._took.append(self._clock() - self._began)
            self._finished, self._began = step, None
            hold, self._hold = self._hold == step, self._hold if self._hold > step else -1
            return (self._leave if step >= self._leave_after else None), hold

    def request_audit(self, audit: Audit) -> None:
        """The coordinator asks this spare to re-do a seat's step (an audit)."""
        with self.condition:
            self._audits.append(audit)
            self.condition.notify_all()

    def next_audit(self) -> Audit | None:
        """A spare: the oldest audit asked of it and not yet taken."""
        with self.condition:
            return self._audits.popleft() if self._audits else None

    def wait_terminal(self, timeout: float) -> Stop | Fenced | None:
        """The coordinator's Fenced or Stop, waited for at most `timeout` seconds (None: none came)."""
        deadline = time.monotonic() + timeout
        with self.condition:
            while self._terminal is None and (remaining := deadline - time.monotonic()) > 0:
                self.condition.wait(min(remaining, 0.5))
            return self._terminal

    def is_confirmed(self, generation: str, step: int) -> bool:
        with self.condition:
            return (generation, step) in self._confirmed

    def pending(self) -> bool:
        """A command is queued for the compute thread (a view, a Prepare, the end)."""
        return bool(self._commands)

    def pause(self, epoch: int, seconds: float) -> bool:
        """Sleep `seconds`, or less: False when a newer view than `epoch` is being prepared, or a command came."""
        deadline = time.monotonic() + seconds
        with self.condition:
            while not self._commands and not self.interrupted(epoch):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                self.condition.wait(remaining)
            return False

    def take(self, timeout: float, what: str) -> Command:
        """Next command, waiting at most `timeout` seconds.

        Raises:
            WaitTimeout: nothing arrived in time; `what` names the wait in the message.
        """
        deadline = time.monotonic() + timeout
        with self.condition:
            while not self._commands:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"no word from the coordinator within {timeout:.0f}s while {what}")
                self.condition.wait(min(remaining, 1.0))
            return self._commands.popleft()[0]

    def poll(self) -> Command | None:
        """Next command if one is queued, without waiting."""
        with self.condition:
            return self._commands.popleft()[0] if self._commands else None

    def untaken(self) -> tuple[Command, float] | None:
        """The oldest command the compute thread has not taken yet, and when it arrived (monotonic)."""
        with self.condition:
            return self._commands[0] if self._commands else None

    def wait_until(self, predicate: Callable[[], bool], epoch: int, timeout: float, what: str) -> bool:
        """Wait for `predicate` (checked under the lock); False if interrupted first.

        Raises:
            WaitTimeout: neither happened within `timeout`.
        """
        deadline = time.monotonic() + timeout
        with self.condition:
            while not predicate():
                if self.interrupted(epoch):
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"{what}: not done within {timeout:.0f}s, and no word from the coordinator")
                self.condition.wait(min(remaining, 0.5))
            return True
