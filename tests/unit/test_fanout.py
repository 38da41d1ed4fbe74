"""Broadcasts through host agents (coordinator/fanout.py, agent/relay.py): one send per host, and the nets.

The sans-I/O coordinator on a virtual clock (the ``Job`` of test_coordinator_service)
whose one host agent started every member and was heard just now: a round's Prepare
and the view that ends it go to the agent once, as a Relay header naming the workers;
a member a lost relay left behind (its agent gone silent) gets the Prepare or the
view again, directly, a grace period later.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from test_coordinator_service import Job, ack
from test_coverage import host_beat

from deadpool.agent.relay import AckBatcher, pass_on
from deadpool.config import Config
from deadpool.coordinator import fanout
from deadpool.coordinator.records import Agent, Send
from deadpool.events.catalogue import Event
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    AckBatch,
    CommitView,
    Fenced,
    Heartbeat,
    Message,
    Prepare,
    ProcessExited,
    Relay,
    ViewDelta,
    Welcome,
)
from deadpool.protocol.transport import Frame, TransportError

ALL = ["m0", "m1", "m2", "s0"]


def relayed(sends: list[Send], kind: type) -> dict[str, list[str]]:
    """agent address -> the workers a relay of `kind` named."""
    return {s.address: s.relay.to for s in sends if s.relay is not None and isinstance(s.message, kind)}


def direct(sends: list[Send], kind: type) -> set[str]:
    return {s.address for s in sends if s.relay is None and isinstance(s.message, kind)}


def covered_job() -> Job:
    """A 3-seat job whose agent was heard just now."""
    job = Job(seats=3, spares=1)
    job.now += 0.25
    job.handle(host_beat(ALL))
    job.raw.clear()
    return job


def test_a_round_and_its_view_go_once_to_the_agent_of_the_hosts_workers() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    assert relayed(job.raw, Prepare) == {"inproc://agent": ["inproc://m0", "inproc://m2", "inproc://s0"]}
    assert direct(job.raw, Prepare) == set()
    job.raw.clear()
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    assert job.epoch == 2
    assert relayed(job.raw, ViewDelta) == {"inproc://agent": ["inproc://m0", "inproc://s0", "inproc://m2"]}


def test_without_a_recent_word_from_the_agent_or_with_relays_off_every_member_gets_its_own_copy() -> None:
    job = covered_job()
    job.now += 2 * Config().heartbeat_interval + 0.01  # the agent's last HostHeartbeat is too old to relay through
    job.handle(ProcessExited("agent-h0", "m1", -9))
    assert relayed(job.raw, Prepare) == {}
    assert direct(job.raw, Prepare) == {"inproc://m0", "inproc://m2", "inproc://s0"}
    off = Job(seats=3, spares=1, config=Config(relay_broadcasts=False))
    off.handle(host_beat(ALL))
    off.handle(ProcessExited("agent-h0", "m1", -9))
    assert relayed(off.raw, Prepare) == {} and len(direct(off.raw, Prepare)) == 3


def test_a_survivor_silent_after_a_relayed_prepare_whose_agent_fell_silent_gets_it_again_directly() -> None:
    grace = fanout.grace(Config().heartbeat_interval)
    for agent_alive in (True, False):
        job = covered_job()
        job.handle(ProcessExited("agent-h0", "m1", -9))
        job.handle(ack("m0", 2, [7, 8], {2: [7]}))  # m2 has not answered yet
        job.now += grace - 0.01
        if agent_alive:
            job.handle(host_beat(["m0", "m2", "s0"]))
        job.raw.clear()
        job.tick()
        assert direct(job.raw, Prepare) == set(), "not before the grace"
        job.now += 0.02
        job.tick()
        # Only the survivor that has not answered, and only when its agent is gone: a live one passed it on.
        assert direct(job.raw, Prepare) == (set() if agent_alive else {"inproc://m2"})
        job.raw.clear()
        job.now += grace
        job.tick()
        assert direct(job.raw, Prepare) == set(), "once"


def test_a_member_beating_on_its_own_still_on_the_old_view_a_grace_after_the_commit_gets_it_again_once() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    job.handle(ack("m2", 2, [7, 8], {1: [6, 7]}))
    assert job.epoch == 2
    job.raw.clear()
    job.handle(Heartbeat("m0", 1, 7, 7, 6, 0.0, "inproc://m0"))  # within the grace, behind is only slow
    assert direct(job.raw, ViewDelta) == set()
    job.now += fanout.grace(Config().heartbeat_interval)
    for _ in range(2):
        job.handle(Heartbeat("m0", 1, 7, 7, 6, 0.0, "inproc://m0"))
        job.handle(Heartbeat("m2", 2, 7, 7, 6, 0.0, "inproc://m2"))  # holds it: nothing to send
    assert [s.address for s in job.raw if isinstance(s.message, ViewDelta)] == ["inproc://m0"], "once, the delta"
    job.raw.clear()
    job.handle(Heartbeat("s0", 0, 7, 7, 6, 0.0, "inproc://s0"))  # it holds no view at all: the whole view
    assert [type(s.message) for s in job.raw if s.address == "inproc://s0"] == [CommitView]


class Recorder:
    """A transport that records the frames sent to each address, and refuses some addresses."""

    def __init__(self, refuse: set[str]) -> None:
        self.sent: dict[str, bytes] = {}
        self.refuse = refuse

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        if address in self.refuse:
            raise TransportError(f"{address} refused")
        self.sent[address] = bytes(frames[0])


def test_the_agent_passes_the_frame_on_unchanged_and_names_the_workers_it_could_not_reach() -> None:
    frame = codec.encode(Prepare(2, [1], "m1 died"), b"secret")
    transport = Recorder(refuse={"tcp://w2"})
    missed = asyncio.run(pass_on(transport, Relay(["tcp://w0", "tcp://w2"], term=1), frame, 1.0))  # type: ignore[arg-type]
    assert transport.sent == {"tcp://w0": frame}, "byte for byte, still under the coordinator's MAC"
    assert missed == ["tcp://w2"]


def test_a_relay_is_two_frames_whose_header_each_agent_gets_once_per_view() -> None:
    relay = Relay(["tcp://w0", "tcp://w1"])
    pieces = [Prepare(2, [1], "a"), Prepare(3, [1], "b")]
    sends = [Send("tcp://agent", pieces[0], relay), Send("tcp://w9", pieces[0]), Send("tcp://agent", pieces[1], relay)]
    frames = [f for _, f in fanout.encoded(sends, None)]
    assert [len(f) for f in frames] == [2, 1, 2]
    assert frames[0][0] is frames[2][0], "one header for both pieces"
    assert frames[0][1] is frames[1][0], "one encoding of a broadcast"
    assert codec.decode(frames[0][0]) == relay


def test_the_answers_of_a_hosts_workers_come_up_together_and_count_whoever_carried_them() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    job.handle(AckBatch.of("agent-h0", [ack("m0", 2, [7, 8], {2: [7]}), ack("ghost", 2, [7, 8], {})]))
    assert any(r.get("reason") == "unknown_peer" and "ghost" in r.get("detail", "") for r in job.of(Event.REJECTED))
    assert job.epoch == 1, "m2 has not answered"
    # After a takeover the new coordinator may not know yet which agent started m2: its answer still counts.
    job.handle(AckBatch.of("agent-unknown", [ack("m2", 2, [7, 8], {1: [6, 7]})]))
    assert job.epoch == 2


def test_a_batch_of_full_answers_counts_each_member_as_heard_and_commits_once_all_are_in() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    job.now += 0.1
    job.handle(AckBatch.of("agent-h0", [ack("m0", 2, [7, 8], {2: [7]}), ack("m2", 2, [7, 8], {1: [6, 7]})]))
    view = job.coordinator.view
    assert job.epoch == 2 and view is not None and view.resume_step == 7 and view.restore_from == {1: "m2"}
    assert job.coordinator.members["m0"].last_seen == job.coordinator.members["m2"].last_seen == job.now


def test_a_batch_whose_columns_differ_in_length_is_refused_whole() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    batch = AckBatch.of("agent-h0", [ack("m0", 2, [7, 8], {2: [7]}), ack("m2", 2, [7, 8], {1: [6, 7]})])
    job.handle(dataclasses.replace(batch, steps=[8]))
    assert any(r.get("reason") == "bad_field" and "AckBatch" in r.get("detail", "") for r in job.of(Event.REJECTED))
    assert job.epoch == 1 and job.coordinator.round is not None and not job.coordinator.round.acks
    job.handle(batch)
    assert job.epoch == 2


def test_a_fenced_member_in_a_batch_is_told_so_and_the_others_count() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    assert "m1" in job.coordinator.fenced
    job.raw.clear()
    job.handle(AckBatch.of("agent-h0", [ack("m0", 2, [7, 8], {2: [7]}), ack("m1", 2, [7, 8], {}),
                                        ack("m2", 2, [7, 8], {1: [6, 7]})]))
    assert any(r.get("reason") == "fenced_peer" and r.get("peer") == "m1" for r in job.of(Event.REJECTED))
    assert direct(job.raw, Fenced) == {"inproc://m1"}
    assert job.epoch == 2


def test_an_early_answer_in_a_batch_does_not_replace_a_full_one() -> None:
    job = covered_job()
    job.handle(ProcessExited("agent-h0", "m1", -9))
    job.handle(ack("m0", 2, [7, 8], {2: [7]}))
    early = dataclasses.replace(ack("m0", 2, [8], {}), early=True)
    job.handle(AckBatch.of("agent-h0", [early]))
    rnd = job.coordinator.round
    assert rnd is not None and rnd.acks["m0"].local_steps == [7, 8] and not rnd.acks["m0"].early
    job.handle(AckBatch.of("agent-h0", [ack("m2", 2, [7, 8], {1: [6, 7]})]))
    assert job.epoch == 2


def test_the_agent_holds_its_workers_answers_for_one_message_and_keeps_a_failed_one_for_the_next() -> None:
    batcher = AckBatcher("agent-a", ["w0", "w1"])
    assert batcher.take() is None
    assert batcher.add(ack("w0", 2, [7], {})) and batcher.add(ack("w1", 2, [7], {}))
    assert not batcher.add(ack("stranger", 2, [7], {}))
    batch = batcher.take()
    assert batch is not None and batch.members == ["w0", "w1"] and batch.sender == "agent-a"
    assert batcher.take() is None
    batcher.add(ack("w0", 3, [8], {}))
    batcher.put_back(batch)
    again = batcher.take()
    assert again is not None and [(a.sender, a.epoch) for a in again.answers()] == [("w0", 2), ("w1", 2), ("w0", 3)]


def test_a_hosts_members_apart_in_the_list_still_share_one_relay_in_the_lists_order() -> None:
    out = fanout.Fanout(heartbeat_interval=0.5, relay=True)
    out.hello("agent-a", ["a0", "a1", "a2"])
    out.hello("agent-b", ["b0", "b1"])
    agents = {name: Agent(name, f"host-{name}", f"tcp://{name[-1]}", {}, 10.0) for name in ("agent-a", "agent-b")}
    control = {m: f"tcp://{m}" for m in ["a0", "a1", "a2", "b0", "b1", "x"]} | {"mute": ""}
    plan = out.plan(["a0", "b0", "a1", "x", "mute", "stranger", "b1", "a2"], control, agents, now=10.2, term=1)
    assert plan.relays == [("tcp://a", Relay(["tcp://a0", "tcp://a1", "tcp://a2"], 1)),
                           ("tcp://b", Relay(["tcp://b0", "tcp://b1"], 1))]
    assert plan.direct == ["tcp://x"], "no address, or no record: skipped"
    again = out.plan(["a0", "a1", "a2", "b0"], control, agents, now=10.3, term=1)
    assert again.relays[0] == plan.relays[0], "an unchanged host: an equal header (encoded once, below)"
    assert again.direct == ["tcp://b0"], "one recipient on a host gets its own copy"
    assert out.plan(["a0", "a1", "a2"], control, agents, now=10.3, term=2).relays[0][1].term == 2


def test_a_header_the_fanout_sends_again_is_encoded_once_across_broadcasts() -> None:
    headers: dict[str, tuple[Relay, bytes]] = {}
    relay = Relay(["tcp://w0", "tcp://w1"], 1)
    first = [f for _, f in fanout.encoded([Send("tcp://agent", Prepare(2, [1], "a"), relay)], None, headers)]
    again = Relay(["tcp://w0", "tcp://w1"], 1)  # the next broadcast's header: another object, equal
    second = [f for _, f in fanout.encoded([Send("tcp://agent", Prepare(3, [1], "b"), again)], None, headers)]
    assert second[0][0] is first[0][0]
    changed = Relay(["tcp://w0"], 1)
    third = [f for _, f in fanout.encoded([Send("tcp://agent", Prepare(4, [1], "c"), changed)], None, headers)]
    assert codec.decode(third[0][0]) == changed and len(headers) == 1


class _Peers:
    """A transport whose peers take a message at once, except those marked full, until the test makes room."""

    def __init__(self) -> None:
        self.full: set[str] = set()
        self.room = asyncio.Event()
        self.got: list[tuple[str, object]] = []
        self.tasks = 0

    def try_send(self, address: str, frames: Sequence[Frame]) -> bool:
        if address in self.full:
            return False
        self.got.append((address, codec.decode(bytes(frames[0]))))
        return True

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        self.tasks += 1
        await asyncio.wait_for(self.room.wait(), timeout)
        self.got.append((address, codec.decode(bytes(frames[0]))))


def test_the_coordinators_sends_go_at_once_and_a_peer_that_waits_gets_the_rest_in_order() -> None:
    from deadpool.coordinator.main import Dispatch

    async def run() -> _Peers:
        peers = _Peers()
        peers.full.add("tcp://slow")
        async with asyncio.TaskGroup() as senders:
            dispatch = Dispatch(peers, None, 1.0, senders)  # type: ignore[arg-type]
            dispatch([Send("tcp://slow", Heartbeat("a", 1, 1, 1, 1, 0.0, "")),
                      Send("tcp://fast", Heartbeat("b", 1, 1, 1, 1, 0.0, ""))])
            peers.full.clear()  # room comes, but the slow peer's first message still waits in its task
            dispatch([Send("tcp://slow", Heartbeat("c", 1, 1, 1, 1, 0.0, ""))])
            assert [to for to, _ in peers.got] == ["tcp://fast"], "only the peer with room took one at once"
            peers.room.set()
            await asyncio.sleep(0)
            while dispatch.pending:
                await asyncio.sleep(0.001)
            dispatch([Send("tcp://slow", Heartbeat("d", 1, 1, 1, 1, 0.0, ""))])  # nothing waits: at once
            assert not dispatch.pending
        return peers

    peers = asyncio.run(run())
    assert [m.sender for to, m in peers.got if to == "tcp://slow"] == ["a", "c", "d"]  # type: ignore[attr-defined]
    assert peers.tasks == 2, "a task for the full peer's send, and for the one sent behind it"


def test_a_message_sent_again_as_the_same_object_is_encoded_once_and_others_are_not_kept() -> None:
    kept: dict[str, tuple[Message, bytes]] = {}
    welcome = Welcome(3, "agent-h0", 8, 1, "")
    first = [f for _, f in fanout.encoded([Send("tcp://agent", welcome, None, True)], None, None, kept)]
    second = [f for _, f in fanout.encoded([Send("tcp://agent", welcome, None, True)], None, None, kept)]
    assert second[0][0] is first[0][0] and codec.decode(first[0][0]) == welcome
    newer = Welcome(4, "agent-h0", 8, 1, "")  # the next epoch: another object, encoded anew
    third = [f for _, f in fanout.encoded([Send("tcp://agent", newer, None, True)], None, None, kept)]
    assert codec.decode(third[0][0]) == newer and kept["tcp://agent"][0] is newer
    joined = Welcome(4, "m0", 8, 1, "")  # a member's own Welcome, once: not kept
    assert codec.decode([f for _, f in fanout.encoded([Send("tcp://m0", joined)], None, None, kept)][0][0]) == joined
    assert list(kept) == ["tcp://agent"]
