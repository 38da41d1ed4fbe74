"""Failure detection on both paths: a host agent's HostHeartbeat, and a member's own heartbeats.

The sans-I/O coordinator on a virtual clock (the ``Job`` of test_coordinator_service):
a member its agent lists stays alive without beating itself; one the agent stops
listing, or whose agent falls silent, is dead a failure timeout after the last
message that listed it, unless it beats to the coordinator directly.
"""

from __future__ import annotations

import dataclasses

from test_coordinator_service import AGENT, Job

from deadpool.events.catalogue import Event
from deadpool.protocol.messages import (
    ChaosCommand,
    ChaosResult,
    Fenced,
    Heartbeat,
    HostHeartbeat,
    SignalMember,
    Welcome,
)


def host_beat(members: list[str], step: int = 5, agent: str = AGENT) -> HostHeartbeat:
    n = len(members)
    return HostHeartbeat(agent, list(members), [1] * n, [step] * n, [step] * n, [step - 1] * n,
                         [f"inproc://{m}" for m in members], [0.25] * n)


def run(job: Job, seconds: float, listed: list[str], direct: tuple[str, ...] = (), agent_beats: bool = True) -> None:
    """Time passes in 0.25 s steps: the agent lists `listed`, the `direct` members beat themselves."""
    end = job.now + seconds
    while job.now < end:
        job.now = round(job.now + 0.25, 6)
        if agent_beats:
            job.handle(host_beat(listed))
        for member in direct:
            job.handle(Heartbeat(member, job.epoch, 5, 5, 4, 0.0, f"inproc://{member}"))
        job.tick()


def dead(job: Job) -> dict[str, str]:
    return {r["member"]: r["detected_by"] for r in job.of(Event.MEMBER_FAILED)}


def test_members_listed_by_their_agent_stay_alive_without_their_own_heartbeats() -> None:
    job = Job(seats=3, spares=1)
    run(job, 10.0, ["m0", "m1", "m2", "s0"])  # four failure timeouts, not one direct beat
    assert dead(job) == {}
    seat = job.coordinator.status(job.now)["seats"][1]  # the columns reach what operators read
    assert (seat["member"], seat["step"], seat["stall_p99_s"]) == ("m1", 5, 0.25)
    assert seat["heartbeat_age_s"] <= 0.25  # heard through its agent, though it never beat itself


def test_a_member_the_agent_stops_listing_is_dead_one_timeout_after_the_last_listing() -> None:
    job = Job(seats=3, spares=1)
    run(job, 1.0, ["m0", "m1", "m2", "s0"])
    last_listed = job.now
    run(job, 1.75, ["m0", "m2", "s0"])  # m1 hung: its agent no longer hears it
    assert dead(job) == {}, "not before failure_timeout (2 s) has passed"
    run(job, 0.5, ["m0", "m2", "s0"])
    assert dead(job) == {"m1": "heartbeat"}
    failed = job.of(Event.MEMBER_FAILED)[0]
    assert failed["ts"] - last_listed == 2.25  # the first tick past the timeout, counted from the last listing
    assert "no heartbeat for 2.25s" in failed["reason"]


def test_members_whose_agent_is_gone_survive_on_their_own_heartbeats_and_the_silent_ones_die() -> None:
    job = Job(seats=3, spares=1)
    run(job, 1.0, ["m0", "m1", "m2", "s0"])
    # The agent dies: m0, m2 and s0 beat to the coordinator themselves; m1 does not (it died with the host's agent).
    run(job, 6.0, [], direct=("m0", "m2", "s0"), agent_beats=False)
    assert dead(job) == {"m1": "heartbeat"}


def test_a_fenced_member_in_a_host_heartbeat_is_told_and_not_vouched_for() -> None:
    job = Job(seats=3, spares=1)
    run(job, 0.5, ["m0", "m1", "m2", "s0"])
    job.coordinator.declare_dead(job.now, "m1", "exit", "test")
    before = job.coordinator.members["m1"].last_seen
    job.handle(host_beat(["m0", "m1", "m2", "s0"], step=9))
    assert [f.member for f in job.to("inproc://m1", Fenced)] != []
    assert job.coordinator.members["m1"].last_seen == before and job.coordinator.members["m1"].step != 9
    assert any(r.get("reason") == "fenced_peer" for r in job.of(Event.REJECTED))


def test_an_agent_speaks_only_for_its_own_members_and_in_columns_of_one_length() -> None:
    job = Job(seats=3, spares=1)
    job.handle(host_beat(["m0", "ghost"]))
    assert {r.get("detail") for r in job.of(Event.REJECTED) if r.get("reason") == "not_agents_member"} == {"ghost"}
    job.handle(HostHeartbeat(AGENT, ["m0", "m1"], [1], [5, 5], [5, 5], [4, 4], ["", ""], [0.0, 0.0]))
    assert any(r.get("reason") == "bad_field" for r in job.of(Event.REJECTED))
    job.handle(host_beat(["m0"], agent="agent-unknown"))
    assert any(r.get("reason") == "unknown_agent" for r in job.of(Event.REJECTED))


def test_a_chaos_command_armed_for_a_step_fires_when_the_agents_columns_reach_it() -> None:
    """Progress from host heartbeats reaches the records only when read; an armed command reads it at once."""
    job = Job(seats=3, spares=1)
    run(job, 0.5, ["m0", "m1", "m2", "s0"])  # step 5
    job.handle(ChaosCommand("kill", 1, "", 7, "inproc://operator", 1))
    assert [r.ok for r in job.to("inproc://operator", ChaosResult)] == [True]
    job.handle(host_beat(["m0", "m1", "m2", "s0"], step=6))
    assert not job.to("inproc://agent", SignalMember)
    job.handle(host_beat(["m0", "m1", "m2", "s0"], step=7))
    assert [(s.member, s.action) for s in job.to("inproc://agent", SignalMember)] == [("m1", "kill")]


def test_a_repeated_hello_keeps_the_agents_record_and_is_welcomed_and_a_changed_one_registers_anew() -> None:
    job = Job(seats=3, spares=1)
    hello = job.coordinator.agents[AGENT].hello
    assert hello is not None
    record = job.coordinator.agents[AGENT]
    job.now += 1.0
    job.raw.clear()
    job.handle(dataclasses.replace(hello))  # equal, not the same object (decoded again)
    assert job.coordinator.agents[AGENT] is record and record.seen == job.now
    assert [s.address for s in job.raw if isinstance(s.message, Welcome)] == ["inproc://agent"]
    moved = dataclasses.replace(hello, control_addr="inproc://agent-2", members={**hello.members, "m0": 99})
    job.handle(moved)
    again = job.coordinator.agents[AGENT]
    assert again is not record and again.control_addr == "inproc://agent-2" and again.members["m0"] == 99


def test_the_same_heartbeat_object_again_renews_its_members_and_a_fenced_one_is_still_told() -> None:
    """A repeated frame decodes to the very message accepted last (codec.Recent): its members are heard again
    without their columns being looked at, until one of them is fenced; then it is answered for as before."""
    job = Job(seats=3, spares=1)
    beat = host_beat(["m0", "m1", "m2", "s0"])
    for _ in range(12):  # three failure timeouts of one repeated message
        job.now = round(job.now + 0.25, 6)
        job.handle(beat)
        job.tick()
    assert dead(job) == {}
    job.coordinator.declare_dead(job.now, "m1", "exit", "test")
    job.handle(beat)
    assert job.to("inproc://m1", Fenced) != []
    assert any(r.get("reason") == "fenced_peer" and r.get("peer") == "m1" for r in job.of(Event.REJECTED))


def test_members_covered_for_many_timeouts_are_still_judged_when_their_agent_drops_them_or_goes() -> None:
    """Covered for long, members leave the direct-message bookkeeping (Liveness); losing their agent's word
    still makes them silent from its last listing, and their own beats still keep them alive."""
    job = Job(seats=3, spares=1)
    run(job, 8.0, ["m0", "m1", "m2", "s0"])  # four failure timeouts: each has come up silent in Liveness
    last_listed = job.now
    run(job, 2.5, ["m0", "m2", "s0"])  # m1 hung
    assert dead(job) == {"m1": "heartbeat"}
    assert job.of(Event.MEMBER_FAILED)[0]["ts"] - last_listed == 2.25
    run(job, 6.0, [], direct=("m0", "s0"), agent_beats=False)  # the agent is gone: m2 never beats itself
    assert dead(job) == {"m1": "heartbeat", "m2": "heartbeat"}
