"""Planned moves in the membership service (no sockets, a virtual clock) and the decision that checks them.

A move asks the member to leave (``Leave``); its ``LeaveAt`` has every other seat told to hold after that step
(``Hold``) and the reserved spare told to fetch the seat's state of it (``Takeover``); its ``Leaving`` fences it
(the answer is its cue to exit 0) and starts the round that seats the reserved spare; a drain releases the host's
spares first. Refusals answer the operator with one line and leave the job as it was.
"""

from __future__ import annotations

import io
from typing import Any

from deadpool.tools.status import render_status
from rich.console import Console

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.moves import HOLD_WAIT_S
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Trigger
from deadpool.protocol.messages import (
    AgentHello,
    Fenced,
    Heartbeat,
    Hold,
    Holding,
    Join,
    Leave,
    LeaveAt,
    Leaving,
    Message,
    MoveCommand,
    MoveResult,
    Prepare,
    PrepareAck,
    ProcessExited,
    Role,
    Stop,
    Takeover,
)
from deadpool.protocol.view import View

OPERATOR = "inproc://operator"


class TwoHosts:
    """A coordinator of 4 seats on hosts a and b (2 each) with one spare per host."""

    def __init__(self, config: Config | None = None) -> None:
        self.now = 100.0
        self.events = EventLog(None, clock=lambda: self.now)
        self.events.records = []
        self.coordinator = Coordinator(config or Config(), 4, "store:1", self.events, started=self.now,
                                       wall_clock=lambda: self.now)
        self.sent: list[Send] = []
        self.hosts = {"m0": "a", "m1": "a", "m2": "b", "m3": "b", "sa": "a", "sb": "b"}
        for host in ("a", "b"):
            members = {m: 10 + i for i, (m, h) in enumerate(self.hosts.items()) if h == host}
            self.handle(AgentHello(f"agent-{host}", host, f"inproc://agent-{host}", members))
        for spare in ("sa", "sb"):
            self.handle(Join(spare, Role.SPARE, -1, 0, 10, self.hosts[spare], f"inproc://{spare}", f"tcp://{spare}"))
        for seat in range(4):
            member = f"m{seat}"
            self.handle(Join(member, Role.ACTIVE, seat, 4, 10, self.hosts[member], f"inproc://{member}",
                             f"tcp://{member}"))
        self.nonce = 0

    def handle(self, message: Message) -> list[Send]:
        return self.handle_all(self.coordinator.handle(self.now, message))

    def handle_all(self, sends: list[Send]) -> list[Send]:
        for send in sends:
            self.sent += [Send(addr, send.message) for addr in send.relay.to] if send.relay else [send]
        return sends

    def ask(self, seat: int = -1, host: str = "", spare: str = "") -> MoveResult:
        self.nonce += 1
        self.handle(MoveCommand(seat, "", spare, host, "", OPERATOR, self.nonce))
        results = [s.message for s in self.sent if s.address == OPERATOR and isinstance(s.message, MoveResult)]
        assert results and results[-1].nonce == self.nonce
        return results[-1]

    def to(self, member: str, kind: type[Message]) -> list[Any]:
        return [s.message for s in self.sent if s.address == f"inproc://{member}" and isinstance(s.message, kind)]

    def of(self, event: Event) -> list[dict[str, Any]]:
        assert self.events.records is not None
        return [r for r in (line.fields() for line in self.events.records) if r["event"] == event]

    @property
    def view(self) -> View:
        assert self.coordinator.view is not None
        return self.coordinator.view


def test_a_move_asks_the_member_to_leave_and_its_leaving_seats_the_reserved_spare_at_that_step() -> None:
    job = TwoHosts()
    result = job.ask(seat=1)
    assert result.ok and "rank 1 moves to sb" in result.detail, result  # a spare on another host first
    assert [leave.reason for leave in job.to("m1", Leave)] == ["operator move"]
    assert job.coordinator.status(job.now)["moves"][0] | {"asked_s": 0} == {
        "rank": 1, "member": "m1", "spare": "sb", "trigger": "operator", "reason": "operator move", "asked_s": 0,
        "leaves_after": None}
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_status(job.coordinator.status(job.now)))
    assert "moving: rank 1 (m1) to sb at its next step boundary (operator: operator move" in console.export_text()
    job.handle(LeaveAt("m1", job.view.epoch, 7))
    holds = {member: job.to(member, Hold) for member in ("m0", "m1", "m2", "m3", "sa", "sb")}
    assert {m: [(h.step, h.moving) for h in told] for m, told in holds.items() if told} == {
        m: [(7, "m1")] for m in ("m0", "m2", "m3")}, "every other seat holds after step 7; spares are not told"
    takeovers = {member: job.to(member, Takeover) for member in ("m0", "m1", "m2", "m3", "sa", "sb")}
    assert {m: [(t.step, t.moving) for t in told] for m, told in takeovers.items() if told} == {"sb": [(7, "m1")]}, \
        "the reserved spare, and only it, fetches the seat's state of step 7 as the seats end it"
    assert job.coordinator.status(job.now)["moves"][0]["leaves_after"] == 7
    job.handle(LeaveAt("m0", job.view.epoch, 7))
    assert job.of(Event.REJECTED)[-1]["detail"] == "LeaveAt from a member not asked to move"
    again = job.ask(seat=1)
    assert not again.ok and again.detail == "rank 1 is already moving"
    job.handle(Leaving("m1", job.view.epoch, 7))
    job.handle(Holding("m0", job.view.epoch, 7))
    job.handle(Holding("m2", job.view.epoch, 8))  # told too late: it had ended step 7 and gone on
    assert not job.to("m1", Fenced) and not job.to("m0", Prepare), "m3 may still be in step 7's collectives"
    job.handle(Holding("m3", job.view.epoch, 7))
    assert "m1" in job.coordinator.fenced and job.to("m1", Fenced), "its Fenced is its cue to exit 0"
    prepare = job.to("m0", Prepare)[-1]
    assert prepare.failed_seats == [1] and prepare.replacements == {1: "sb"}
    assert [e["step"] for e in job.of(Event.SEAT_LEFT)] == [7]
    for member in ("m0", "m2", "m3"):
        job.handle(PrepareAck(member, prepare.epoch, 7, [7], {1: [6, 7]} if member == "m2" else {}))
    assert job.view.seats[1] == "sb" and job.view.resume_step == 7, "resumes after the step the member left at"
    committed = job.of(Event.VIEW_COMMITTED)[-1]
    assert committed["trigger"] == Trigger.MOVE
    assert not job.of(Event.MEMBER_FAILED), "a move is not a failure"
    assert job.coordinator.status(job.now)["moves"] == []


def test_a_drain_releases_the_hosts_spares_and_moves_its_seats_elsewhere() -> None:
    job = TwoHosts()
    job.handle(Join("sb2", Role.SPARE, -1, 0, 10, "b", "inproc://sb2", "tcp://sb2"))
    assert job.view.spares == ["sa", "sb", "sb2"]
    result = job.ask(host="a")
    assert result.ok and result.detail == "rank 0 moves to sb, rank 1 moves to sb2", result
    assert job.to("sa", Stop) and job.view.spares == ["sb", "sb2"], "a's spare left the pool"
    assert job.to("m0", Leave) and job.to("m1", Leave) and not job.to("m2", Leave)
    assert job.coordinator.status(job.now)["drained_hosts"] == ["a"]
    assert job.of(Event.VIEW_COMMITTED)[-1]["trigger"] == Trigger.DRAIN
    assert {e["host"] for e in job.of(Event.MOVE_REQUESTED)} == {"a"}
    assert job.ask(host="a").detail == "host a is drained already"


def test_refusals_say_why_and_how_many_spares_are_missing_and_change_nothing() -> None:
    job = TwoHosts()
    epoch = job.view.epoch
    assert job.ask(seat=9).detail == "no rank 9 in the job (ranks 0..3)"
    assert job.ask(host="c").detail == "no host 'c' in the job (hosts: a, b)"
    refused = job.ask(host="b")
    assert not refused.ok and refused.missing == 1
    assert refused.detail == "2 seat(s) to move but 1 free spare(s) on hosts other than b: 1 spare(s) missing"
    assert job.ask(seat=0, spare="nobody").detail == "spare nobody is not free in the pool (free: sa, sb)"
    assert job.view.epoch == epoch and not job.to("m0", Leave) and not job.of(Event.MOVE_REQUESTED)


def test_check_moves_refuses_draining_every_seat_and_moves_during_a_round() -> None:
    hosts = {"m0": "a", "m1": "a", "s0": "b"}
    view = View(1, ["m0", "m1"], ["s0"], -1, "epoch-1", "127.0.0.1:1", {}, hosts, [1, 0], {})
    assert decisions.check_moves(view, [0, 1], "a", "", hosts, set(), set(), False, set())[1] == \
        "host a holds every seat of the job: draining it would leave none"
    assert decisions.check_moves(view, [0], "", "", hosts, set(), set(), True, set())[1] == \
        "a view change is in progress: ask again once it has committed"
    moves, why, missing = decisions.check_moves(view, [0], "", "", hosts, set(), {"s0"}, False, set())
    assert not moves and missing == 1, why
    assert decisions.check_moves(view, [1], "", "", hosts, set(), set(), False, set())[0] == {1: "s0"}


def test_early_answers_that_name_an_older_step_do_not_commit_a_move() -> None:
    job = TwoHosts()
    assert job.ask(seat=1).ok
    job.handle(Leaving("m1", job.view.epoch, 7))
    assert not job.to("m0", Prepare), "no seat said it ended step 7"
    for second in range(int(HOLD_WAIT_S)):  # the seats' word did not come within the bound: the move goes on
        assert not job.to("m0", Prepare), f"{second} s: the seats' heartbeats say they are still in step 7"
        job.now += 1.0
        for member in ("m0", "m1", "m2", "m3", "sa", "sb"):
            job.handle(Heartbeat(member, job.view.epoch, 6, 6, 5, 0.0, f"inproc://{member}"))
        job.handle_all(job.coordinator.tick(job.now))
    prepare = job.to("m0", Prepare)[-1]
    for member in ("m0", "m2", "m3"):  # mid-step: the copy of step 7 still in flight, only 6 complete
        job.handle(PrepareAck(member, prepare.epoch, 8, [6], {1: [6, 7]} if member == "m2" else {}, early=True))
    assert job.view.seats[1] == "m1", "committing at step 6 would redo step 7"
    for member in ("m0", "m2", "m3"):  # from the boundary, every copy complete
        job.handle(PrepareAck(member, prepare.epoch, 7, [6, 7], {1: [6, 7]} if member == "m2" else {}))
    assert job.view.seats[1] == "sb" and job.view.resume_step == 7


def test_a_seat_not_told_to_hold_is_known_to_have_ended_the_step_from_its_heartbeats() -> None:
    job = TwoHosts()
    assert job.ask(seat=1).ok
    job.handle(Leaving("m1", job.view.epoch, 7))
    job.handle(Holding("m0", job.view.epoch, 7))
    job.handle(Holding("m3", job.view.epoch, 7))
    job.handle(Heartbeat("m2", job.view.epoch, 6, 6, 5, 0.0, "inproc://m2"))
    assert not job.to("m0", Prepare)
    job.handle(Heartbeat("m2", job.view.epoch, 7, 7, 6, 0.0, "inproc://m2"))
    job.handle_all(job.coordinator.tick(job.now))  # after every batch of messages
    assert job.to("m0", Prepare)[-1].replacements == {1: "sb"}


def test_a_seat_that_dies_before_it_leaves_is_repaired_as_any_failure() -> None:
    job = TwoHosts()
    assert job.ask(seat=1).ok
    job.handle(ProcessExited("agent-a", "m1", -9))  # killed on its way to the boundary
    assert [e["member"] for e in job.of(Event.MEMBER_FAILED)] == ["m1"]
    prepare = job.to("m0", Prepare)[-1]
    assert prepare.failed_seats == [1] and prepare.replacements, "the usual repair, with a spare of the pool"
    assert job.coordinator.status(job.now)["moves"] == [], "the move is over: the failure's repair replaces it"
    job.handle(Leaving("m1", job.view.epoch, 7))  # a late word from the fenced member changes nothing
    assert not job.of(Event.SEAT_LEFT)


def test_slowness_scores_seats_against_the_median_and_a_move_pays_only_with_steps_left() -> None:
    scores = decisions.slowness({0: 0.1, 1: 0.3, 2: 0.1, 3: 0.11, 4: 0.0})
    assert scores == {0: 1.0, 1: 3.0, 2: 1.0, 3: 1.1}, "a seat that told nothing yet is left out"
    assert decisions.slowness({0: 0.2}) == {}
    pays, why = decisions.slow_move(3.0, 0.3, 30, 2.0, free_spares=2, reserve=1)
    assert pays and "6.00 s over the 30 step(s) left; a move costs 2.00 s" in why
    assert not decisions.slow_move(3.0, 0.3, 3, 2.0, 2, 1)[0], "3 steps left: 0.6 s, less than a move"
    assert decisions.slow_move(3.0, 0.3, 30, 2.0, 1, 1) == (False, "1 free spare(s), 1 kept for failures "
                                                                  "(--slow-reserve)")


def test_a_seat_slow_for_long_enough_is_reported_once_and_moved_when_it_pays() -> None:
    job = TwoHosts(Config(replace_slow=True, slow_steps=2, total_steps=100))
    for step in range(5, 10):
        job.now += 2.1
        for seat in range(4):
            compute = 0.6 if seat == 2 and step >= 6 else 0.2
            job.handle(Heartbeat(f"m{seat}", job.view.epoch, step, step, step - 1, 0.0, f"inproc://m{seat}", compute))
        for spare in ("sa", "sb"):
            job.handle(Heartbeat(spare, job.view.epoch, -1, -2, -2, 0.0, f"inproc://{spare}"))
        job.coordinator.tick(job.now)
    (slow,) = job.of(Event.SEAT_SLOW)
    assert slow["rank"] == 2 and slow["score"] == 3.0 and slow["moved"], slow["reason"]
    assert job.coordinator.status(job.now)["seats"][2]["slowness"] == 3.0
    (asked,) = job.of(Event.MOVE_REQUESTED)
    assert asked["rank"] == 2 and asked["trigger"] == "slow"
