"""Planned moves: a seated member hands its seat to a spare at a step boundary, with no finished step redone.

An operator asks (``deadpool move``, ``deadpool drain``) or a host's launcher does on a preemption notice.
The coordinator checks the request (``decisions.check_moves``: the seats exist, none is moving already,
there are spares enough where they may go), reserves a spare per seat and tells each moving member to
leave (``Leave``). The member answers with the step it leaves after (``LeaveAt``: the one it is in, or the
next when that one is nearly over), and every other seat is told to hold at that step's end (``Hold``);
each says when it is there (``Holding``). The reserved spare is told too (``Takeover``): it fetches the
seat's state of that step as the seats end it. The member stops after that step, waits until its buddy
confirmed its snapshot of it and says so (``Leaving``). Once every seat has ended the step, the member is
fenced (it exits 0 on that) and its seat is replaced as a dead one's is, by a round whose Prepare names the
reserved spare; every seat holds that step's snapshot, so the job resumes after it. A drain first takes the
host's spares out of the pool (they are released, as at the job's end).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deadpool.coordinator import decisions
from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.pools import Addresses
from deadpool.coordinator.records import MemberRecord
from deadpool.coordinator.rounds import Rounds
from deadpool.coordinator.swaps import Swaps
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import MoveTrigger, Trigger
from deadpool.protocol.messages import (
    Fenced,
    Hold,
    Holding,
    Leave,
    LeaveAt,
    Leaving,
    MoveCommand,
    MoveResult,
    Stop,
    Takeover,
)

PREEMPTION = "preemption"  # a MoveCommand reason starting with this is a launcher's notice (agent/preemption.py)
PREEMPTION_WINDOW_S = 1.5  # notices are held this long: one from every host means the whole job is being stopped
HOLD_WAIT_S = 5.0  # a move waits this long for every seat to end the step the member left after


@dataclass
class Move:
    """One seat on its way to a spare."""

    seat: int
    member: str
    spare: str
    trigger: MoveTrigger
    reason: str
    asked: float  # when the coordinator told the member to leave
    after: int = -1  # the step it leaves after, once it said (``LeaveAt``, then ``Leaving``)
    left: float = 0.0  # when it said it stopped (``Leaving``)


class Moves:
    """The moves in progress (by moving member) and the hosts drained."""

    def __init__(self, events: EventLog, views: Views, rounds: Rounds, swaps: Swaps, outbox: Outbox,
                 members: Mapping[str, MemberRecord], addrs: Addresses, fenced: dict[str, str], coverage: Coverage,
                 wall: Callable[[], float]) -> None:
        self._events = events
        self._views = views
        self._rounds = rounds
        self._swaps = swaps
        self._out = outbox
        self._members = members
        self._addrs = addrs
        self._fenced = fenced
        self._coverage = coverage
        self._wall = wall
        self._moving: dict[str, Move] = {}
        self.drained: set[str] = set()  # hosts whose seats moved away and whose spares left
        self._notices: dict[str, tuple[MoveCommand, float]] = {}  # host -> a launcher's preemption notice, held
        self._left: dict[str, Move] = {}  # moving members that stopped, waiting for every seat to end their step
        self._ended: dict[str, int] = {}  # seat's member -> the newest step it ended and said so (a move waits)

    def command(self, command: MoveCommand, now: float) -> None:
        """An operator's (or a launcher's) request: refused with one line, or started (every Leave sent). A
        launcher's preemption notice waits out the window first (``tick``)."""
        if command.host and command.reason.startswith(PREEMPTION):
            self._notices.setdefault(command.host, (command, now))
            return
        self._start(command, now)

    def tick(self, now: float) -> None:
        """Moves whose seats did not all say they ended the step within the bound; preemption notices whose
        window passed: all refused when every host of the job sent one (the job is being stopped), else each
        started in turn."""
        self._prune()
        self._seat_the_spares(now)
        if not self._notices or now - min(at for _, at in self._notices.values()) < PREEMPTION_WINDOW_S:
            return
        notices, self._notices = self._notices, {}
        view = self._views.current
        hosts = {self._addrs.host.get(m, "") for m in (*view.seats, *view.spares)} - {""} if view else set()
        if hosts and hosts <= notices.keys():
            why = (f"SIGTERM reached every host of the job ({len(hosts)}) within {PREEMPTION_WINDOW_S:g} s: the job "
                   "is being stopped, not drained")
            for command, _ in notices.values():
                self._out.send(command.reply_to, MoveResult(command.nonce, False, why))
            return
        for command, _ in sorted(notices.values(), key=lambda item: item[1]):
            self._start(command, now)

    def start_slow(self, seat: int, reason: str, now: float) -> str:
        """A move for slowness (``slowness.py``): "" once started, else why not."""
        return self._start(MoveCommand(seat, "", "", "", reason, "", 0), now, MoveTrigger.SLOW)

    def free_spares(self) -> int:
        """How many spares of the pool no move has reserved, on hosts not drained."""
        return len(self.free_pool())

    def free_pool(self) -> list[str]:
        """The spares of the pool no move has reserved, on hosts not drained, in the pool's order."""
        view = self._views.current
        reserved = {move.spare for move in self._moving.values()}
        return [spare for spare in (view.spares if view else []) if spare not in reserved
                and self._addrs.host.get(spare, "") not in self.drained]

    def _start(self, command: MoveCommand, now: float, trigger: MoveTrigger | None = None) -> str:
        """Check `command` and answer it; start its moves. Returns why it was refused ("": started)."""
        self._prune()
        view = self._views.current
        detail, missing = "no view committed yet: the job has not started", 0
        moves: dict[int, str] = {}
        if trigger is None:
            trigger = MoveTrigger.DRAIN if command.host else MoveTrigger.OPERATOR
        if command.reason.startswith(PREEMPTION):
            trigger = MoveTrigger.PREEMPTION
        if view is not None:
            seats = self._seats_asked(command)
            moves, detail, missing = decisions.check_moves(
                view, seats, command.host, command.spare, self._addrs.host,
                {move.seat for move in self._moving.values()}, {move.spare for move in self._moving.values()},
                self._rounds.current is not None, self.drained)
        if not moves or view is None:
            self._out.send(command.reply_to, MoveResult(command.nonce, False, detail, missing))
            return detail
        if command.host:
            self._release_spares(command.host, command.reason)
        reason = command.reason or ("drain of host " + command.host if command.host else "operator move")
        for seat, spare in sorted(moves.items()):
            member = view.seats[seat]
            self._moving[member] = Move(seat, member, spare, trigger, reason, now)
            self._events.emit(schema.MoveRequested(member=member, rank=seat, spare=spare, trigger=trigger,
                                                   reason=reason, host=command.host))
            record = self._members.get(member)
            if record is not None:
                self._out.send(record.control_addr, Leave(member, view.epoch, reason))
        self._out.send(command.reply_to, MoveResult(command.nonce, True, detail))
        return ""

    def leave_at(self, message: LeaveAt) -> None:
        """A moving member will stop after `message.step`: every other seat holds at the end of that step, and the
        reserved spare fetches the seat's state of it meanwhile."""
        move = self._moving.get(message.sender)
        view = self._views.current
        if move is None or view is None:
            self._events.emit(schema.Rejected(reason="unexpected_type", peer=message.sender,
                                              detail="LeaveAt from a member not asked to move"))
            return
        move.after = message.step
        for member in view.seats:
            record = self._members.get(member)
            if member != message.sender and record is not None:
                self._out.send(record.control_addr, Hold(member, view.epoch, message.step, message.sender))
        spare = self._members.get(move.spare) if move.spare else None
        if spare is not None:
            self._out.send(spare.control_addr, Takeover(move.spare, view.epoch, message.step, message.sender))

    def holding(self, message: Holding, now: float) -> None:
        """A seat ended the step it was told to hold after (or had ended it): the moves waiting for it may go on."""
        view = self._views.current
        if view is None or message.epoch != view.epoch:
            return  # from a view before a repair: the step it names may be redone
        self._ended[message.sender] = max(message.step, self._ended.get(message.sender, -1))
        self._seat_the_spares(now)

    def leaving(self, message: Leaving, now: float) -> None:
        """A moving member stopped after `message.step`, its buddy holding its snapshot of it: its seat goes to the
        reserved spare once every other seat has ended that step too (``_seat_the_spares``)."""
        self._prune()
        move = self._moving.pop(message.sender, None)
        view = self._views.current
        if move is None or view is None or view.seat_of(message.sender) != move.seat:
            self._events.emit(schema.Rejected(reason="unexpected_type", peer=message.sender,
                                              detail="Leaving from a member not asked to move"))
            return
        move.after, move.left = message.step, now
        self._left[message.sender] = move
        self._ended[message.sender] = max(message.step, self._ended.get(message.sender, -1))
        self._seat_the_spares(now)

    def _seat_the_spares(self, now: float) -> None:
        """Start the round that seats the reserved spares of the members that left, once every seat has ended the
        step they left after: a seat still in that step's collectives would be interrupted by the round's Prepare,
        and the job would resume a step earlier. Without word from every seat within ``HOLD_WAIT_S``, or when a
        round started meanwhile (a failure), it starts at once (the seats still in the step roll back). A seat that
        was not told to hold (its hold was cleared by an earlier Prepare) is known to have ended the step from its
        heartbeats."""
        view = self._views.current
        if not self._left or view is None:
            return
        step = min(move.after for move in self._left.values())
        since = min(move.left for move in self._left.values())

        def ended(member: str) -> int:  # its word (``Holding``), or else its heartbeats' (a seat not told to hold)
            record = self._members.get(member)
            beat = record.step if record is not None and record.epoch == view.epoch else -1
            return max(self._ended.get(member, -1), beat)

        if any(ended(member) < step for member in view.seats) and now - since < HOLD_WAIT_S \
                and self._rounds.current is None:
            return
        left, self._left = self._left, {}
        self._ended.clear()
        for member, move in sorted(left.items(), key=lambda item: item[1].seat):
            why = f"moved to {move.spare} after step {move.after} ({move.reason})"
            self._fenced[member] = why
            self._coverage.forget(member)
            self._swaps.failed(member, self._wall())
            self._events.emit(schema.SeatLeft(member=member, rank=move.seat, step=move.after))
            record = self._members.get(member)
            if record is not None:
                self._out.send(record.control_addr, Fenced(member, view.epoch, why))  # its cue to exit 0
            self._rounds.start(now, {move.seat: member}, f"seat {move.seat} moves: {move.reason}", Trigger.MOVE,
                               preferred={move.seat: move.spare} if move.spare else None, wanted=move.after)

    def _prune(self) -> None:
        """A moving member that died is replaced by the failure's repair instead; a reserved spare that died
        leaves its move to the round's own choice."""
        for member, move in list(self._moving.items()):
            if member in self._fenced:
                del self._moving[member]
            elif move.spare in self._fenced:
                move.spare = ""
        for member in [member for member in self._left if member in self._fenced]:
            del self._left[member]  # it died after it left: the failure's repair replaced it

    def status(self) -> dict[str, object]:
        """Moves in progress and drained hosts, for ``deadpool status``."""
        self._prune()
        moves = [*self._moving.values(), *self._left.values()]
        return {"moves": [{"rank": m.seat, "member": m.member, "spare": m.spare, "trigger": m.trigger,
                           "reason": m.reason, "asked_s": round(self._out.now - m.asked, 3),
                           "leaves_after": m.after if m.after >= 0 else None}
                          for m in sorted(moves, key=lambda m: m.seat)],
                "drained_hosts": sorted(self.drained)}

    def _seats_asked(self, command: MoveCommand) -> list[int]:
        view = self._views.current
        assert view is not None
        if command.host:
            return [seat for seat, member in enumerate(view.seats) if self._addrs.host.get(member) == command.host]
        if command.member:
            seat = view.seat_of(command.member)
            return [-1 if seat is None else seat]
        return [command.seat]

    def _release_spares(self, host: str, reason: str) -> None:
        """The drained host's spares leave the pool in a view of their own and are released."""
        view = self._views.current
        assert view is not None
        self.drained.add(host)
        gone = [s for s in view.spares if self._addrs.host.get(s) == host]
        if not gone:
            return
        why = f"host {host} drained ({reason})" if reason else f"host {host} drained"
        for spare in gone:
            self._fenced[spare] = why
            self._coverage.forget(spare)
            record = self._members.get(spare)
            if record is not None:
                self._out.send(record.control_addr, Stop(True, why))
        if self._rounds.current is None:
            spares = [s for s in view.spares if s not in gone]
            new_view = decisions.next_view(view, view.epoch + 1, {}, spares, view.resume_step, self._addrs.host,
                                           self._addrs.bulk, rebuild=False, changed=self._addrs.changed)
            self._views.commit(new_view, why, failed={}, trigger=Trigger.DRAIN)
