"""Answers to a round's Prepare: a member's own ``PrepareAck``, or a host agent's ``AckBatch`` of them.

A round waits for every survivor's answer, so a view change at 131,072 members reads 124,518 of them
within a few ticks, nearly all in agents' batches. The usual batch (from a registered agent, every
member it names known and not fenced, each a full answer to the running round) is taken in one pass:
the agent's rate limit once, each member heard and its answer kept, one look at whether the round can
commit. Any other batch goes answer by answer through the coordinator's own path, as if each member
had sent its answer itself, which rejects and logs what does not belong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from deadpool.coordinator.liveness import Liveness
from deadpool.coordinator.pools import Survivors
from deadpool.coordinator.ratelimit import RateLimit
from deadpool.coordinator.records import Agent, MemberRecord, Round
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import AckBatch, Message, PrepareAck


class Coordinator(Protocol):
    """What answers read and change of the coordinator (``service.Coordinator``)."""

    round: Round | None
    members: dict[str, MemberRecord]
    agents: dict[str, Agent]
    fenced: dict[str, str]
    events: EventLog
    _rate: RateLimit
    _live: Liveness
    _survivors_cache: Survivors

    def _epoch(self) -> int: ...

    def _maybe_commit(self) -> None: ...


def on_ack(c: Coordinator, ack: PrepareAck) -> None:
    """A member's answer (its sender known, not fenced, heard): kept for the round it answers, if any."""
    rnd = c.round
    if rnd is None or not rnd.first_epoch <= ack.epoch <= rnd.epoch:  # or a full answer after an early one
        if rnd is not None or ack.epoch != c._epoch():
            c.events.emit(Event.REJECTED, reason="stale_ack", peer=ack.sender, ack_epoch=ack.epoch)
        return
    held = rnd.acks.get(ack.sender)
    if ack.early and held is not None and not held.early:
        return  # a full answer (kept from an earlier Prepare of the round) beats a later early one
    rnd.acks[ack.sender] = ack
    c._survivors_cache.answered(rnd, ack.sender, ack.early)
    c._maybe_commit()


def on_batch(c: Coordinator, batch: AckBatch, now: float, handle: Callable[[float, Message], None]) -> None:
    """An agent's answers: the usual batch in one pass, any other one by one through `handle`.

    An answer is the member's own word, which the agent only carries: a batch from an agent the
    coordinator does not know (one that has just taken over) still counts, answer by answer.
    """
    count = len(batch.members)
    if not (count == len(batch.epochs) == len(batch.steps) == len(batch.local_steps) == len(batch.ward_steps)
            == len(batch.disk_steps) == len(batch.dirty_groups) == len(batch.early)):  # no generator per batch
        c.events.emit(Event.REJECTED, reason="bad_field", peer=batch.sender,
                      detail="AckBatch columns of different lengths")
        return
    agent, rnd, records = c.agents.get(batch.sender), c.round, c.members
    if agent is not None:
        agent.seen = now
    answers = batch.answers()
    try:
        heard = list(map(records.__getitem__, batch.members))
    except KeyError:  # someone the coordinator does not know: answer by answer, which rejects it
        heard = []
    if (agent is None or rnd is None or not count or len(heard) != count or True in batch.early
            or not rnd.first_epoch <= min(batch.epochs) <= max(batch.epochs) <= rnd.epoch
            or not c.fenced.keys().isdisjoint(batch.members)):
        for answer in answers:
            handle(now, answer)
        return
    if not c._rate.allow(batch.sender, now):  # the agent's batch counts as one message of the agent's
        return
    for record in heard:
        record.last_seen = now
    c._live.seen_all(batch.members, now)
    rnd.acks.update(zip(batch.members, answers, strict=True))
    c._survivors_cache.all_answered(rnd, batch.members)
    c._maybe_commit()
