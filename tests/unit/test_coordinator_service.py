"""The membership service without sockets: the sans-I/O Coordinator on an injected, virtual clock.

Every call returns what the coordinator wants sent; these tests read those sends
and the events, and never open a socket or sleep.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest

from deadpool.config import Config, FreezeOnCommit
from deadpool.coordinator.decisions import Trigger
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.events import schema
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import (
    AgentHello,
    ChaosInjected,
    CollectiveFailed,
    CommitView,
    Fenced,
    FenceKill,
    Heartbeat,
    HostHeartbeat,
    Join,
    Message,
    Prepare,
    PrepareAck,
    ProcessExited,
    Rejoin,
    Role,
    StepReport,
    Stop,
    ViewDelta,
    Welcome,
)

AGENT = "agent-h0"


class Job:
    """A coordinator for `seats` seats, its clock, and everything it sent and logged."""

    def __init__(self, seats: int = 3, spares: int = 1, config: Config | None = None, late: bool = True) -> None:
        self.now = 100.0
        self.events = EventLog(None, clock=lambda: self.now)
        self.events.records = []
        self.coordinator = Coordinator(config or Config(), seats, "store:1", self.events, started=self.now,
                                       wall_clock=lambda: self.now)
        self.sent: list[Send] = []  # what each address received (a relayed broadcast: each worker its copy)
        self.raw: list[Send] = []  # what the coordinator sent (a relay: one send to the agent)
        self.seats = [f"m{i}" for i in range(seats)]
        self.spares = [f"s{i}" for i in range(spares)]
        started = [*self.seats, *self.spares, *(["s-late"] if late else [])]  # s-late: a spare joining late
        self.handle(AgentHello(AGENT, "h0", "inproc://agent", {m: 10 + i for i, m in enumerate(started)}))
        for member in self.spares:  # spares first: the first view, formed by the last seat's Join, holds them
            self.handle(join(member, Role.SPARE, -1, seats))
        for i, member in enumerate(self.seats):
            self.handle(join(member, Role.ACTIVE, i, seats))

    def handle(self, message: Message) -> list[Send]:
        return self._record(self.coordinator.handle(self.now, message))

    def tick(self) -> list[Send]:
        return self._record(self.coordinator.tick(self.now))

    def _record(self, sends: list[Send]) -> list[Send]:
        self.raw.extend(sends)
        for send in sends:
            self.sent += [Send(addr, send.message) for addr in send.relay.to] if send.relay else [send]
        return sends

    def advance(self, seconds: float, alive: list[str]) -> None:
        """Let time pass in heartbeat-sized steps, `alive` members beating and the coordinator ticking."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, round(self.now + 0.25, 6))
            for member in alive:
                self.handle(Heartbeat(member, self.epoch, 5, 5, 4, 0.0, f"inproc://{member}"))
            self.tick()

    @property
    def epoch(self) -> int:
        view = self.coordinator.view
        return view.epoch if view else 0

    def to(self, address: str, kind: type[Message]) -> list[Any]:
        return [s.message for s in self.sent if s.address == address and isinstance(s.message, kind)]

    def of(self, event: Event) -> list[dict[str, Any]]:
        assert self.events.records is not None
        return [r for r in (line.fields() for line in self.events.records) if r["event"] == event]


def join(member: str, role: Role, seat: int, world: int) -> Join:
    return Join(member, role, seat, world if role == Role.ACTIVE else 0, 10, "h0", f"inproc://{member}",
                f"tcp://h0:{seat}")


def ack(member: str, epoch: int, local: list[int], wards: dict[int, list[int]]) -> PrepareAck:
    return PrepareAck(member, epoch, max(local), local, wards)


def test_joins_form_the_first_view_and_every_member_is_welcomed() -> None:
    job = Job(seats=3, spares=1)
    view = job.coordinator.view
    assert view is not None and view.epoch == 1
    assert view.seats == ["m0", "m1", "m2"] and view.spares == ["s0"]
    for member in ["m0", "m1", "m2", "s0"]:
        assert len(job.to(f"inproc://{member}", Welcome)) == 1
        assert [c.view.epoch for c in job.to(f"inproc://{member}", CommitView)] == [1]
    committed = job.of(Event.VIEW_COMMITTED)
    assert len(committed) == 1 and committed[0]["trigger"] == Trigger.FIRST_VIEW


def test_no_view_before_every_seat_has_joined() -> None:
    events = EventLog(None)
    coordinator = Coordinator(Config(), 3, "store:1", events)
    for i in (0, 2):
        sends = coordinator.handle(0.0, join(f"m{i}", Role.ACTIVE, i, 3))
        assert [type(s.message) for s in sends] == [Welcome]
    assert coordinator.view is None


def test_an_exit_report_fences_the_member_and_prepares_the_survivors() -> None:
    job = Job(seats=3, spares=1)
    job.sent.clear()
    job.handle(ProcessExited(AGENT, "m1", -9))
    assert "m1" in job.coordinator.fenced
    failed = job.of(Event.MEMBER_FAILED)
    assert failed[0]["member"] == "m1" and failed[0]["detected_by"] == "exit"
    assert job.to("inproc://m1", Fenced)
    assert not job.to("inproc://agent", FenceKill), "the process is gone: nothing to kill"
    prepares = {s.address: s.message for s in job.sent if isinstance(s.message, Prepare)}
    # The survivors and the spare chosen for the seat (it wraps its model meanwhile); never the dead seat.
    assert set(prepares) == {"inproc://m0", "inproc://m2", "inproc://s0"}
    assert all(p.epoch == 2 and p.failed_seats == [1] and p.replacements == {1: "s0"} for p in prepares.values())
    prepared = job.of(Event.VIEW_PREPARED)
    assert prepared[0]["trigger"] == Trigger.SEAT_LOST and prepared[0]["replacements"] == {"1": "s0"}
    assert job.coordinator.view is not None and job.coordinator.view.epoch == 1  # nothing committed yet


def test_acks_commit_the_view_with_the_newest_common_step_and_the_spare_seated() -> None:
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.sent.clear()
    # Buddies ring on one host: seat 1's copies live on seat 2.
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    assert not job.to("inproc://m0", ViewDelta), "one ack is not all of them"
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    view = job.coordinator.view
    assert view is not None and view.epoch == 2
    assert view.seats == ["m0", "s0", "m2"] and view.spares == []
    assert view.resume_step == 7 and view.restore_from == {1: "m2"} and view.store_prefix == "epoch-2"
    # The members of the view before get it as a delta (the spare s0 was one of them).
    assert {s.address for s in job.sent if isinstance(s.message, ViewDelta)} == {
        "inproc://m0", "inproc://s0", "inproc://m2"}
    committed = job.of(Event.VIEW_COMMITTED)[-1]
    assert committed["failed_seats"] == [1] and committed["trigger"] == Trigger.SEAT_LOST
    assert job.coordinator.round is None


def test_the_mesh_groups_survivors_report_unfinished_are_rebuilt_by_the_next_view() -> None:
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(dataclasses.replace(ack("m0", 2, [7, 8], {2: [7]}), dirty_groups=["deadpool:tp:0"]))
    job.handle(dataclasses.replace(ack("m2", 2, [7, 8], {1: [6, 7]}), dirty_groups=["deadpool:tp:0", "deadpool:dp:1"]))
    view = job.coordinator.view
    assert view is not None and view.epoch == 2
    assert view.rebuild_groups == ["deadpool:dp:1", "deadpool:tp:0"], "the union, once each"
    assert job.of(Event.VIEW_COMMITTED)[-1]["rebuild_groups"] == ["deadpool:dp:1", "deadpool:tp:0"]


def test_a_second_failure_in_the_round_keeps_the_spare_already_told_its_seat() -> None:
    """The spare chosen for seat 2 heard the Prepare and may be wrapping its model for seat 2: when seat 0
    fails too before the commit, seat 2 keeps it (the pure pick would move it to seat 0, the lower seat)."""
    job = Job(seats=4, spares=2)
    job.handle(ProcessExited(AGENT, "m2", -9))
    first = job.to("inproc://s0", Prepare)
    assert [p.replacements for p in first] == [{2: "s0"}]
    job.sent.clear()
    job.handle(ProcessExited(AGENT, "m0", -9))
    again = {s.address: s.message for s in job.sent if isinstance(s.message, Prepare)}
    assert set(again) == {"inproc://m1", "inproc://m3", "inproc://s0", "inproc://s1"}
    assert [p.replacements for p in again.values()] == [{0: "s1", 2: "s0"}] * 4


def test_missed_heartbeats_start_a_round() -> None:
    job = Job(seats=3, spares=1)
    job.advance(1.5, alive=["m0", "m1", "m2", "s0"])
    assert not job.of(Event.MEMBER_FAILED)
    job.sent.clear()
    job.advance(2.5, alive=["m0", "m2", "s0"])  # m1 goes silent for more than failure_timeout (2 s)
    failed = job.of(Event.MEMBER_FAILED)
    assert [f["member"] for f in failed] == ["m1"] and failed[0]["detected_by"] == "heartbeat"
    assert [k.member for k in job.to("inproc://agent", FenceKill)] == ["m1"]  # a hang becomes a crash
    assert {s.address for s in job.sent if isinstance(s.message, Prepare)} == {
        "inproc://m0", "inproc://m2", "inproc://s0"}  # the survivors and the spare chosen


def test_stale_epoch_acks_and_unknown_senders_are_rejected() -> None:
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(ack("m0", 1, [8], {}))  # answers an older epoch than the round's
    assert job.coordinator.round is not None and "m0" not in job.coordinator.round.acks
    sends = job.handle(Heartbeat("ghost", 1, 5, 5, 4, 0.0, "inproc://ghost"))
    assert [s.message for s in sends] == [Rejoin(1, "ghost", term=1)]  # asked to join, not accepted
    assert "ghost" not in job.coordinator.members
    before = job.coordinator.members["m1"].last_seen
    job.now += 1.0
    sends = job.handle(Heartbeat("m1", 1, 9, 9, 8, 0.0, "inproc://m1"))  # the fenced member, awake again
    assert [type(s.message) for s in sends] == [Fenced]
    assert job.coordinator.members["m1"].last_seen == before
    reasons = [r["reason"] for r in job.of(Event.REJECTED)]
    assert reasons == ["stale_ack", "unknown_peer", "fenced_peer"]


def test_a_collective_failure_with_nobody_dead_rebuilds_after_a_grace() -> None:
    job = Job(seats=3, spares=1)
    job.handle(CollectiveFailed("m0", 1, 5, "Connection reset by peer"))
    job.advance(0.75, alive=["m0", "m1", "m2", "s0"])
    assert not job.of(Event.VIEW_PREPARED), "within the grace a death may still be found"
    job.advance(0.5, alive=["m0", "m1", "m2", "s0"])
    prepared = job.of(Event.VIEW_PREPARED)
    assert len(prepared) == 1 and prepared[0]["trigger"] == Trigger.BLIND_REBUILD
    assert prepared[0]["failed_seats"] == []


def test_a_collective_report_about_groups_a_later_view_replaced_is_stale_and_rebuilds_nothing() -> None:
    """A survivor's report of the dead seat's broken all-reduce (epoch 1), or an adoption's, reaching the
    coordinator after the swap's view (epoch 2, new groups) is committed: no blind rebuild follows it."""
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    assert job.epoch == 2 and job.coordinator.round is None
    job.handle(CollectiveFailed("m0", 1, 8, "Connection reset by peer"))
    job.advance(2.0, alive=["m0", "s0", "m2"])
    assert not [p for p in job.of(Event.VIEW_PREPARED) if p["trigger"] == Trigger.BLIND_REBUILD]
    stale = [r for r in job.of(Event.REJECTED) if r["reason"] == "stale_collective_report"]
    assert len(stale) == 1 and stale[0]["report_epoch"] == 1 and stale[0]["groups_epoch"] == 2
    # A failure in the groups of the view in force is no stale report: it is rebuilt after the grace.
    job.handle(CollectiveFailed("s0", 2, 8, "Connection reset by peer"))
    job.advance(1.5, alive=["m0", "s0", "m2"])
    assert [p["trigger"] for p in job.of(Event.VIEW_PREPARED)][-1] == Trigger.BLIND_REBUILD


# -- no_spare_policy ------------------------------------------------------------------------------


def test_stop_policy_fails_the_job_at_once_when_no_spare_is_left() -> None:
    job = Job(seats=2, spares=0, late=False)
    job.handle(ProcessExited(AGENT, "m1", -9))
    outcome = job.coordinator.outcome
    assert outcome is not None and not outcome[0]
    assert "rank 1 (m1)" in outcome[1] and "no spare is left" in outcome[1]
    assert job.of(Event.JOB_FAILED) and not job.of(Event.VIEW_PREPARED)
    assert job.to("inproc://m0", Stop) and job.to("inproc://agent", Stop)


@pytest.fixture
def waiting() -> Job:
    job = Job(seats=2, spares=0, config=Config(no_spare_policy="wait", spare_wait_timeout=30.0), late=False)
    job.handle(ProcessExited(AGENT, "m1", -9))
    return job


def test_wait_policy_pauses_the_survivors_and_seats_a_spare_that_joins_later(waiting: Job) -> None:
    job = waiting
    assert job.coordinator.outcome is None
    prepared = job.of(Event.VIEW_PREPARED)
    assert len(prepared) == 1 and "waiting up to 30s" in prepared[0]["reason"]
    assert [p.epoch for p in job.to("inproc://m0", Prepare)] == [2]
    job.handle(ack("m0", 2, [7, 8], {1: [7, 8]}))
    assert job.coordinator.view is not None and job.coordinator.view.epoch == 1, "no seat for rank 1: no commit"

    job.advance(20.0, alive=["m0"])
    assert job.coordinator.outcome is None
    job.handle(join("s-late", Role.SPARE, -1, 2))  # `deadpool launch --nproc 0 --spares 1 --coordinator ...`
    prepared = job.of(Event.VIEW_PREPARED)[-1]
    assert prepared["trigger"] == Trigger.SPARE_JOINED and prepared["replacements"] == {"1": "s-late"}
    # m0's answer to Prepare(2) still counts (it is paused): it is not asked again, and the view commits at once.
    assert [p.epoch for p in job.to("inproc://m0", Prepare)] == [2]
    assert [p.epoch for p in job.to("inproc://s-late", Prepare)] == [3]
    view = job.coordinator.view
    assert view is not None and view.epoch == 3 and view.seats == ["m0", "s-late"]
    assert view.resume_step == 8 and view.restore_from == {1: "m0"}
    assert [c.view.epoch for c in job.to("inproc://s-late", CommitView)] == [3]
    job.advance(40.0, alive=["m0", "s-late"])
    assert job.coordinator.outcome is None, "the wait ended with the commit"


def test_wait_policy_fails_the_job_naming_the_seat_once_the_wait_runs_out(waiting: Job) -> None:
    job = waiting
    job.handle(ack("m0", 2, [7, 8], {1: [7, 8]}))
    job.advance(29.5, alive=["m0"])
    assert job.coordinator.outcome is None
    job.advance(1.0, alive=["m0"])
    outcome = job.coordinator.outcome
    assert outcome is not None and not outcome[0]
    assert "rank 1 (m1)" in outcome[1] and "no spare joined within 30s" in outcome[1]
    assert [r["reason"] for r in job.of(Event.JOB_FAILED)] == [outcome[1]]
    assert job.to("inproc://m0", Stop)


def test_a_spare_that_joins_during_a_round_is_pooled_when_it_commits() -> None:
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(join("s-late", Role.SPARE, -1, 3))
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    view = job.coordinator.view
    assert view is not None and view.seats == ["m0", "s0", "m2"] and view.spares == ["s-late"]


def test_early_acks_commit_when_they_name_a_common_step_and_wait_for_the_full_ones_when_not() -> None:
    """An early ack (sent when the Prepare arrived) names only the newest local snapshot."""
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    early = [dataclasses.replace(ack("m0", 2, [8], {2: [7]}), early=True),
             dataclasses.replace(ack("m2", 2, [8], {1: [6, 7]}), early=True)]  # seat 1's copy lags: 7
    for message in early:
        job.handle(message)
    assert job.coordinator.view is not None and job.coordinator.view.epoch == 1, "no step every seat holds: wait"
    assert job.coordinator.outcome is None and not job.of(Event.DISK_FALLBACK)
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))  # the full answers, from the boundary
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    assert job.coordinator.view.epoch == 2 and job.coordinator.view.resume_step == 7
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))  # a late full answer for the committed epoch: expected, not stale
    assert not job.of(Event.REJECTED)


def test_early_acks_that_name_a_common_step_commit_at_once() -> None:
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(dataclasses.replace(ack("m0", 2, [8], {2: [8]}), early=True))
    job.handle(dataclasses.replace(ack("m2", 2, [8], {1: [7, 8]}), early=True))
    assert job.coordinator.view is not None and job.coordinator.view.epoch == 2
    assert job.coordinator.view.resume_step == 8 and job.coordinator.view.restore_from == {1: "m2"}


def test_early_acks_that_would_restore_a_survivor_from_its_buddy_wait_for_the_full_ones() -> None:
    """Seat 1's copy lags at step 7 while the survivors' newest is 8: their early answers name only 8, so the
    plan would fetch the survivors' step 7 from their buddies; their full answers say they hold 7 themselves."""
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(dataclasses.replace(ack("m0", 2, [8], {2: [7, 8]}), early=True))
    job.handle(dataclasses.replace(ack("m2", 2, [8], {1: [7], 0: [7, 8]}), early=True))
    assert job.coordinator.view is not None and job.coordinator.view.epoch == 1, "wait for the full answers"
    job.handle(ack("m0", 2, [7, 8], {2: [7, 8]}))
    job.handle(ack("m2", 2, [7, 8], {1: [7], 0: [7, 8]}))
    assert job.coordinator.view.epoch == 2 and job.coordinator.view.resume_step == 7
    assert job.coordinator.view.restore_from == {1: "m2"}, "only the lost seat restores from a copy"


def test_status_shows_the_newest_events_compacted() -> None:
    """Kept as emitted (compacting each of 131,072 joins cost startup time), compacted when status asks."""
    job = Job(seats=3, spares=1)
    job.coordinator.events.emit(schema.Rejected(reason="bad_field", detail="x" * 500))
    job.coordinator.events.emit(schema.ViewAdopted(seats=["m0"] * 1000, spares=[], resume_step=0, reported_by="m0"))
    recent = job.coordinator.status(job.now)["recent_events"]
    assert recent[0]["event"] == Event.MEMBER_JOINED and recent[-1]["event"] == Event.VIEW_ADOPTED
    assert len(recent[-2]["detail"]) == 200 and "seats" not in recent[-1]
    assert all(not isinstance(v, (list, dict)) for record in recent for v in record.values())


def test_a_coordinator_freezes_what_is_alive_once_per_committed_view() -> None:
    """FreezeOnCommit: a new epoch moves the heap out of the collector's walks; the same epoch again does not."""
    frozen = FreezeOnCommit()
    try:
        frozen.committed(1)
        held = gc.get_freeze_count()
        assert held > 0
        kept = [[n] for n in range(100)]  # tracked objects made after the freeze
        frozen.committed(1)
        assert gc.get_freeze_count() == held, "the same view: nothing frozen again"
        frozen.committed(2)
        assert gc.get_freeze_count() >= held + len(kept)
    finally:
        gc.unfreeze()


def test_members_found_silent_in_one_tick_are_replaced_by_one_round() -> None:
    """A burst of deaths found by one silence check costs one round (one Prepare to each survivor), not one each."""
    job = Job(seats=5, spares=2)
    job.advance(1.5, alive=["m0", "m1", "m2", "m3", "m4", "s0", "s1"])
    job.sent.clear()
    job.advance(2.5, alive=["m0", "m2", "m4", "s0", "s1"])  # m1 and m3 go silent together
    assert sorted(f["member"] for f in job.of(Event.MEMBER_FAILED)) == ["m1", "m3"]
    prepared = job.of(Event.VIEW_PREPARED)
    assert [(p["epoch"], p["failed_seats"]) for p in prepared] == [(2, [1, 3])]
    assert "seat 1 lost" in prepared[0]["reason"] and "seat 3 lost" in prepared[0]["reason"]
    prepares = [s.message for s in job.sent if s.address == "inproc://m0" and isinstance(s.message, Prepare)]
    assert [(p.epoch, p.failed_seats, sorted(p.replacements)) for p in prepares] == [(2, [1, 3], [1, 3])]


def test_spares_lost_while_no_round_runs_leave_the_pool_in_one_view() -> None:
    job = Job(seats=3, spares=3)
    job.advance(1.5, alive=["m0", "m1", "m2", "s0", "s1", "s2"])
    job.advance(2.5, alive=["m0", "m1", "m2", "s1"])  # s0 and s2 go silent together
    assert [(r["epoch"], r["spares"], r["trigger"]) for r in job.of(Event.VIEW_COMMITTED)][1:] == [
        (2, ["s1"], Trigger.SPARE_LOST)]
    assert [r["spares_left"] for r in job.of(Event.SPARE_LOST)] == [2, 1]
    assert not job.of(Event.VIEW_PREPARED)


def test_a_members_own_heartbeat_newer_than_its_agents_columns_is_what_status_shows() -> None:
    job = Job(seats=2, spares=1)
    job.now += 0.25
    job.handle(HostHeartbeat(AGENT, ["m0", "m1"], [1, 1], [7, 7], [7, 7], [6, 6], ["", ""], [0.0, 0.0]))
    job.now += 0.25
    job.handle(Heartbeat("m1", 1, 8, 8, 7, 0.5, "inproc://m1"))  # its own beat, after the agent's columns
    seats = job.coordinator.status(job.now)["seats"]
    assert [(s["member"], s["step"], s["stall_p99_s"]) for s in seats] == [("m0", 7, 0.0), ("m1", 8, 0.5)]


def test_columns_older_than_a_members_own_message_reach_status_once_the_agent_renews_them() -> None:
    job = Job(seats=2, spares=1)
    beat = HostHeartbeat(AGENT, ["m0", "m1", "s0"], [1] * 3, [7] * 3, [7] * 3, [6] * 3, [""] * 3, [0.0] * 3)
    job.now += 0.25
    job.handle(beat)  # the first listing of these members
    job.now += 0.25
    job.handle(HostHeartbeat(AGENT, beat.members, beat.epochs, [8] * 3, [8] * 3, [7] * 3, [""] * 3, [0.0] * 3))
    job.now += 0.25
    job.handle(StepReport("m1", 1, 7))  # its own message, later than the columns that say step 8
    assert [s["step"] for s in job.coordinator.status(job.now)["seats"]] == [8, 7]
    job.now += 0.25
    job.handle(HostHeartbeat(AGENT, beat.members, beat.epochs, [8] * 3, [8] * 3, [7] * 3, [""] * 3, [0.0] * 3))
    assert [s["step"] for s in job.coordinator.status(job.now)["seats"]] == [8, 8]  # the same columns, renewed


def test_a_prepare_names_the_step_a_chaos_spec_killed_its_failed_member_at() -> None:
    # Every survivor keys an at=recovery spec on it: told late, one may pause still in the step before.
    job = Job(seats=3, spares=1)
    job.handle(ProcessExited(AGENT, "m2", -9))
    assert {p.failure_step for p in job.to("inproc://m0", Prepare)} == {-1}, "no spec fired: unknown"
    job = Job(seats=3, spares=1)
    job.handle(ChaosInjected("m1", "kill", 1, 6, job.now))
    job.sent.clear()
    job.handle(ProcessExited(AGENT, "m1", -9))
    prepares = [s.message for s in job.sent if isinstance(s.message, Prepare)]
    assert prepares and all(p.failure_step == 6 for p in prepares)


def test_a_seat_lost_before_a_started_spare_joined_waits_for_it_under_the_stop_policy() -> None:
    # A spare still importing its script when a seat fails early: its launcher listed it, it has not joined.
    job = Job(seats=2, spares=0)
    job.handle(ProcessExited(AGENT, "m1", -9))
    assert job.coordinator.outcome is None
    assert "the 1 process(es) the launchers started" in job.of(Event.VIEW_PREPARED)[0]["reason"]
    job.handle(ack("m0", 2, [7, 8], {1: [7, 8]}))
    job.advance(5.0, alive=["m0"])
    job.handle(join("s-late", Role.SPARE, -1, 2))
    view = job.coordinator.view
    assert view is not None and view.seats == ["m0", "s-late"] and job.coordinator.outcome is None


def test_a_started_spare_that_exits_before_it_joins_is_not_waited_for() -> None:
    job = Job(seats=2, spares=0)
    job.handle(ProcessExited(AGENT, "s-late", 1))
    job.handle(ProcessExited(AGENT, "m1", -9))
    outcome = job.coordinator.outcome
    assert outcome is not None and not outcome[0] and "no spare is left" in outcome[1]


def test_a_started_spare_that_never_joins_fails_the_job_once_the_wait_runs_out() -> None:
    job = Job(seats=2, spares=0, config=Config(spare_wait_timeout=30.0))
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(ack("m0", 2, [7, 8], {1: [7, 8]}))
    job.advance(29.5, alive=["m0"])
    assert job.coordinator.outcome is None
    job.advance(1.0, alive=["m0"])
    outcome = job.coordinator.outcome
    assert outcome is not None and "did not join within 30s" in outcome[1] and "rank 1 (m1)" in outcome[1]


def test_a_resumed_job_starts_every_seat_from_the_newest_checkpoint_all_of_them_reported() -> None:
    events = EventLog(None)
    events.records = []
    coordinator = Coordinator(Config(checkpoint_dir="/ckpt", resume=True), 2, "store:1", events)
    for seat, steps in ((0, [3, 5]), (1, [1, 3, 5, 7])):
        coordinator.handle(0.0, dataclasses.replace(join(f"m{seat}", Role.ACTIVE, seat, 2), disk_steps=steps))
    view = coordinator.view
    assert view is not None and view.resume_step == 5 and view.restores_from_disk(0) and view.restores_from_disk(1)
    assert "resuming from the disk checkpoint of step 5" in events.records[-1].fields()["reason"]


def test_an_agents_repeated_hello_is_answered_with_the_same_welcome_until_the_epoch_moves() -> None:
    job = Job(seats=3, spares=1)
    hello = job.coordinator.agents[AGENT].hello
    assert hello is not None
    first, again = (job.handle(hello)[0] for _ in range(2))
    assert again.message is first.message and again.again and isinstance(first.message, Welcome)
    assert first.message.epoch == job.epoch == 1 and first.message.member == AGENT
    job.handle(ProcessExited(AGENT, "m1", -9))
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    assert job.epoch == 2
    later = job.handle(hello)[0].message
    assert isinstance(later, Welcome) and later is not first.message and later.epoch == job.epoch


def test_an_active_killed_before_the_first_view_is_replaced_in_it() -> None:
    """A bad node found at start-up: rank 1's process dies (joined or not) before every seat joined; the first
    view seats a spare there, from the initial state like every seat, and its first step completes the swap."""
    for joined in (False, True):
        events = EventLog(None, clock=lambda: 0.0)
        events.records = []
        coordinator = Coordinator(Config(), 3, "store:1", events, started=0.0, wall_clock=lambda: 0.0)
        coordinator.handle(0.0, AgentHello(AGENT, "h0", "inproc://agent", {"m0": 10, "m1": 11, "m2": 12, "s0": 13}))
        coordinator.handle(0.0, join("s0", Role.SPARE, -1, 3))
        coordinator.handle(0.0, join("m0", Role.ACTIVE, 0, 3))
        if joined:
            coordinator.handle(0.0, join("m1", Role.ACTIVE, 1, 3))
        coordinator.handle(0.0, ProcessExited(AGENT, "m1", -9, seat_hint=1))
        assert coordinator.view is None and coordinator.outcome is None
        coordinator.handle(0.0, join("m2", Role.ACTIVE, 2, 3))
        view = coordinator.view
        assert view is not None and view.epoch == 1 and view.seats == ["m0", "s0", "m2"] and view.spares == []
        assert view.resume_step == -1 and view.restore_from == {}
        failed = [r for r in (line.fields() for line in events.records) if r["event"] == Event.MEMBER_FAILED]
        assert [f["member"] for f in failed] == ["m1"]
        committed = [r for r in (line.fields() for line in events.records) if r["event"] == Event.VIEW_COMMITTED][0]
        assert committed["failed_seats"] == [1] and "seat 1 taken by spare s0" in committed["reason"]


def test_an_active_lost_before_the_first_view_with_no_spare_fails_the_job_naming_the_seat() -> None:
    events = EventLog(None)
    coordinator = Coordinator(Config(), 2, "store:1", events, started=0.0, wall_clock=lambda: 0.0)
    coordinator.handle(0.0, AgentHello(AGENT, "h0", "inproc://agent", {"m0": 10, "m1": 11}))
    coordinator.handle(0.0, join("m0", Role.ACTIVE, 0, 2))
    coordinator.handle(0.0, ProcessExited(AGENT, "m1", -9, seat_hint=1))
    assert coordinator.outcome is not None and not coordinator.outcome[0]
    assert "rank 1 (m1) failed before training started" in coordinator.outcome[1]


def test_training_finished_names_an_untracked_loader_a_restore_left_behind_from_the_lowest_seat() -> None:
    from deadpool.protocol.messages import Finished

    job = Job(seats=3, spares=1)
    epoch = job.epoch
    job.handle(Finished("m2", epoch, 2, 9, "d" * 64, "DataLoader", "train.py:52", 2))
    job.handle(Finished("m0", epoch, 0, 9, "d" * 64))
    job.handle(Finished("m1", epoch, 1, 9, "d" * 64, "DataLoader", "train.py:50", 3))
    [finished] = job.of(Event.TRAINING_FINISHED)
    assert finished["untracked_rollback"] == {"loader": "DataLoader", "where": "train.py:50", "view": 3, "rank": 1}
    plain = Job(seats=2, spares=0)
    for seat in (0, 1):
        plain.handle(Finished(f"m{seat}", plain.epoch, seat, 9, "d" * 64))
    [finished] = plain.of(Event.TRAINING_FINISHED)
    assert "untracked_rollback" not in finished, "a run no restore left anything behind in says nothing"
