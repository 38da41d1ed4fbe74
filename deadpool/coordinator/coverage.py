"""Members whose host agent vouches for them: failure detection on the batched path and on the direct one.

A host agent forwards its workers' heartbeats as one ``HostHeartbeat`` per
interval.  A member it lists is *covered*: alive as long as its agent's messages
keep listing it.  Covered members leave the coordinator's :class:`Liveness` (its
times of direct messages) once their entry comes up as silent there, and come
back with their next direct message, so a job's steady-state cost grows with its
hosts and not with its members.  A member
its agent stops listing (hung, dead, or the agent itself silent for longer than
the failure timeout) is *dropped*: it is silent from the last message that
listed it, unless it is heard directly (a worker whose agent is gone beats to
the coordinator itself).  Either path is enough to stay alive; silence on both
for ``failure_timeout`` is death.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deadpool.coordinator.liveness import Liveness

Columns = tuple[list[int], list[int], list[int], list[int], list[float], list[float]]  # a HostHeartbeat's columns


@dataclass(slots=True)
class Batch:
    """The newest HostHeartbeat of one agent, as the coordinator last accepted it."""

    at: float  # when it arrived
    listed: list[str]  # its member column, as sent (an unchanged list is compared in one C call)
    columns: Columns  # epochs, steps, snapshots, confirmed snapshots, stalls, computes (HostBeats.settle copies them)
    vouched: frozenset[str]  # the listed members it may vouch for (its own, known, not fenced)
    sent: object = None  # the message it came in: the same object again is a repeated frame (see repeat)


class Coverage:
    """Which agent vouches for which member, and the members that lost their agent's word."""

    def __init__(self) -> None:
        self._batches: dict[str, Batch] = {}
        self._by_member: dict[str, str] = {}  # covered member -> its agent
        self._agents = Liveness()  # agents by their newest HostHeartbeat
        self._dropped: dict[str, float] = {}  # member -> when an agent last listed it
        self._unsettled: dict[str, None] = {}  # agents whose newest columns have not reached the records (settle)

    def previous(self, agent: str) -> Batch | None:
        return self._batches.get(agent)

    def repeat(self, agent: str, now: float, sent: object) -> bool:
        """`agent` sent again the very message it sent last (``codec.Recent`` decodes a repeated frame to the same
        object, so its member list and columns are the ones kept), each member still vouched for: all are heard
        at `now`. One identity test, before anything of the message is read."""
        batch = self._batches.get(agent)
        if batch is None or batch.sent is not sent or len(batch.vouched) != len(batch.listed):
            return False
        batch.at = now
        self._agents.seen(agent, now)
        return True

    def renew(self, agent: str, now: float, listed: list[str], columns: Columns, sent: object) -> bool:
        """`agent` lists the same members as before, each still vouched for: all are heard at `now`, and `columns`
        are its newest (for settle; not compared with the last, which cost more than the copying it spared).
        False when the list is another (see cover)."""
        batch = self._batches.get(agent)
        if batch is None or batch.listed != listed or len(batch.vouched) != len(listed):
            return False
        batch.at, batch.listed, batch.columns, batch.sent = now, listed, columns, sent  # the next repeat is `sent`
        self._agents.seen(agent, now)
        self._unsettled[agent] = None
        return True

    def cover(self, agent: str, now: float, listed: list[str], columns: Columns, vouched: frozenset[str],
              sent: object) -> None:
        """A changed member list: members it no longer lists are dropped (heard last at its previous message)."""
        before = self._batches.get(agent)
        self._unsettled[agent] = None
        if before is not None:
            for member in before.vouched - vouched:
                if self._by_member.get(member) == agent:
                    del self._by_member[member]
                    self._dropped[member] = before.at
        for member in vouched:
            self._by_member[member] = agent
            self._dropped.pop(member, None)
        self._batches[agent] = Batch(now, listed, columns, vouched, sent)
        self._agents.seen(agent, now)

    def take_unsettled(self) -> list[str]:
        """The agents whose columns changed since the last call, oldest change first (and forget them)."""
        agents, self._unsettled = list(self._unsettled), {}
        return agents

    def unsettle(self, agent: str) -> None:
        """`agent`'s columns are to be taken again (some member's record was newer than them)."""
        self._unsettled[agent] = None

    def vouched_times(self, members: Sequence[str]) -> list[float]:
        """When an agent last listed each of `members` (-inf: never, or not since it was forgotten)."""
        batches, dropped = self._batches, self._dropped
        return [batches[agent].at if agent is not None else dropped.get(member, float("-inf"))
                for agent, member in zip(map(self._by_member.get, members), members, strict=True)]

    def forget(self, member: str) -> None:
        """No longer watched (declared dead, or finished): no agent's word counts for it again."""
        agent = self._by_member.pop(member, None)
        if agent is not None:
            batch = self._batches[agent]
            batch.vouched = batch.vouched - {member}
        self._dropped.pop(member, None)

    def all_seen(self, now: float) -> None:
        """This process did not run for a while: every agent counts as heard at `now` (no silence is known)."""
        for batch in self._batches.values():
            batch.at = now
        self._agents.all_seen(now)
        self._dropped = dict.fromkeys(self._dropped, now)

    def silent(self, now: float, timeout: float, live: Liveness,
               heard_directly: Callable[[str], float]) -> dict[str, float]:
        """Members silent on both paths for more than `timeout`, with when they were last heard.

        `live` holds members by their last direct message; `heard_directly` gives the same time for one
        member (from the coordinator's records).  Covered members that come up silent in `live` leave it: while
        covered their agent's word stands for them, and losing it puts them in the dropped, checked below.
        """
        for agent in self._agents.silent(now, timeout):
            self._agents.forget(agent)
            batch = self._batches.pop(agent)
            for member in batch.vouched:
                if self._by_member.get(member) == agent:
                    del self._by_member[member]
                    self._dropped[member] = batch.at
        found: dict[str, float] = {}
        for member, when in live.silent(now, timeout).items():
            if member in self._by_member:
                live.forget(member)
            elif member not in self._dropped:
                found[member] = when
        for member, listed_at in self._dropped.items():  # kept while not covered again: a few per lost agent
            last = max(listed_at, heard_directly(member))
            if now - last > timeout:
                found[member] = last
        return found
