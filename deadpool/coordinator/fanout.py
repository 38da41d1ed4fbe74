"""Broadcasts through host agents: one send per host, not one per member, and the nets for a lost relay.

A member whose host agent started it (its ``AgentHello``) and was heard within the last two heartbeat
intervals gets a broadcast (a Prepare, a view, the coordinators' addresses) through that agent: the coordinator
sends the agent a :class:`~deadpool.protocol.messages.Relay` header naming those workers' control
addresses, then the message's own frame, which the agent passes on unchanged (``agent/relay.py``).
Every other member, and a host with one recipient, gets its own copy.  An agent can die between its
last heartbeat and a relay; two nets catch what it then loses, both direct sends to members whose
agent has gone silent: a survivor that has not answered a relayed Prepare within :func:`grace` gets
it again (:meth:`Fanout.resend`), and a member whose own heartbeats (it beats to the coordinator
itself once its agent is gone) still show an older epoch :func:`grace` after a commit gets its view
again (:class:`CatchUp`).  docs/design/coordinator.md has the argument.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from deadpool.coordinator.records import Agent, MemberRecord, Round, Send
from deadpool.protocol import codec
from deadpool.protocol.messages import Message, Relay

RELAY_WITHIN = 2.0  # heartbeat intervals: an agent heard longer ago than this relays nothing
MAX_KEPT = 65536  # frames kept by address for sends marked again (see encoded): one per agent


def grace(heartbeat_interval: float) -> float:
    """How long a relayed message may take before its direct copy goes: an agent's beat spans two intervals."""
    return max(0.5, 3 * heartbeat_interval)


@dataclass(frozen=True, slots=True)
class Plan:
    """Who gets a broadcast how: their own copy, or through an agent (one Relay header per agent)."""

    direct: list[str]  # control addresses
    relays: list[tuple[str, Relay]]  # (agent's control address, header naming its workers)

    @property
    def relayed(self) -> int:
        """Members reached through their agents."""
        return sum(len(relay.to) for _, relay in self.relays)

    @property
    def count(self) -> int:
        """Members reached."""
        return len(self.direct) + self.relayed

    def sends(self, message: Message) -> list[Send]:
        return [*(Send(addr, message) for addr in self.direct),
                *(Send(agent, message, relay) for agent, relay in self.relays)]


class Fanout:
    """The coordinator's broadcasts: which agent runs which member, how to reach a list of members, and the
    nets for a lost relay."""

    def __init__(self, heartbeat_interval: float, relay: bool) -> None:
        self.within = RELAY_WITHIN * heartbeat_interval if relay else 0.0
        self.grace = grace(heartbeat_interval)
        self.catch_up = CatchUp(self.grace)
        self._agent_of: dict[str, str] = {}  # member -> the agent whose AgentHello listed it last
        self._hosted: dict[str, frozenset[str]] = {}  # agent -> the members of its last hello

    def hello(self, agent: str, members: Iterable[str]) -> None:
        """`agent` started `members` (its AgentHello, repeated every second: indexed when it changes)."""
        listed = frozenset(members)
        if self._hosted.get(agent) != listed:
            self._hosted[agent] = listed
            self._agent_of.update(dict.fromkeys(listed, agent))

    def agent_id(self, member: str) -> str:
        """The agent whose hello listed `member` last ("": none)."""
        return self._agent_of.get(member, "")

    def heard(self, member: str, agents: Mapping[str, Agent], now: float) -> Agent | None:
        """`member`'s agent, if it was heard within the relay window (None: reach the member directly)."""
        return self._heard_agent(self.agent_id(member), agents, now)

    def _heard_agent(self, agent_id: str, agents: Mapping[str, Agent], now: float) -> Agent | None:
        agent = agents.get(agent_id)
        return agent if agent is not None and now - agent.seen <= self.within else None

    def plan(self, members: list[str], control_of: Mapping[str, str], agents: Mapping[str, Agent],
             now: float, term: int, relay: bool = True) -> Plan:
        """How to reach `members` (unknown ones, and ones without a control address, are skipped).

        The members of one host are usually neighbours in `members` (seats in rank order): the lookups and the
        grouping run in C, and Python sees each run of one agent's members once (a view goes to 131,072).
        """
        addrs = list(map(control_of.get, members, itertools.repeat("")))
        if not all(addrs):  # unknown members, and ones known only from a reported view, are skipped
            kept = list(map(bool, addrs))
            members, addrs = list(itertools.compress(members, kept)), list(itertools.compress(addrs, kept))
        if not (relay and self.within > 0 and members):
            return Plan(addrs, [])
        # Where the owning agent changes along the list, found in C; Python then sees each run once.
        owners = list(map(self._agent_of.get, members, itertools.repeat("")))  # "": no agent started it
        ends = list(itertools.compress(range(1, len(owners)),
                                       map(operator.ne, owners, itertools.islice(owners, 1, None))))
        starts = [0, *ends]
        ends.append(len(owners))
        run_owners = list(map(owners.__getitem__, starts))
        runs = list(map(addrs.__getitem__, map(slice, starts, ends)))
        if len(run_owners) != len(set(run_owners)):  # an agent's members in several runs: one relay for them all
            merged: dict[str, list[str]] = {}
            for owner, run in zip(run_owners, runs, strict=True):
                merged.setdefault(owner, []).extend(run)
            run_owners, runs = list(merged), list(merged.values())
        within = self.within
        heard = [a if a is not None and now - a.seen <= within else None for a in map(agents.get, run_owners)]
        direct: list[str] = []
        relays: list[tuple[str, Relay]] = []
        for agent, run in zip(heard, runs, strict=True):
            if agent is None or len(run) == 1:  # not heard (or no agent): directly; one recipient gains nothing
                direct += run
            else:
                relays.append((agent.control_addr, Relay(run, term)))
        return Plan(direct, relays)

    def resend(self, rnd: Round, now: float, survivors: list[str], records: Mapping[str, MemberRecord],
               agents: Mapping[str, Agent]) -> list[Send]:
        """`rnd`'s Prepare went partly through agents and its grace passed: once more, directly, to each survivor
        that has not answered and whose agent is no longer heard (a live agent passed it on)."""
        if now < rnd.resend_at or rnd.prepare is None:
            return []
        rnd.resend_at = float("inf")
        prepare = rnd.prepare
        return [Send(records[m].control_addr, prepare) for m in itertools.filterfalse(rnd.acks.__contains__, survivors)
                if self.heard(m, agents, now) is None]


def encoded(sends: Iterable[Send], secret: bytes | None, headers: dict[str, tuple[Relay, bytes]] | None = None,
            kept: dict[str, tuple[Message, bytes]] | None = None) -> Iterator[tuple[Send, list[bytes]]]:
    """Each send with its frames: a broadcast's message encoded once (consecutive sends share it), a Relay
    header once per agent however many of a view's pieces it precedes. `headers` (agent's address -> its last
    header and frame), kept by the caller across calls, spares re-encoding a header equal to the one before it
    (an agent's workers and the term rarely change between broadcasts). `kept` (address -> the last message
    sent there with ``Send.again``, and its frame), likewise: an agent's hello, every second, is answered with
    the very Welcome object of the time before while nothing in it changed; one entry per agent (bounded)."""
    last: tuple[Message | None, bytes] = (None, b"")
    headers = {} if headers is None else headers
    for send in sends:
        message = send.message
        if last[0] is not message:
            if send.again and kept is not None:
                frame = kept.get(send.address)
                if frame is None or frame[0] is not message:
                    if len(kept) >= MAX_KEPT:  # agents, and the addresses strangers give: bounded
                        kept.clear()
                    frame = kept[send.address] = (message, codec.encode(message, secret))
                last = frame
            else:
                last = (message, codec.encode(message, secret))
        if send.relay is None:
            yield send, [last[1]]
            continue
        header = headers.get(send.address)
        if header is None or (header[0] is not send.relay and header[0] != send.relay):
            header = headers[send.address] = (send.relay, codec.encode(send.relay, secret))
        yield send, [header[1], last[1]]


class CatchUp:
    """A member whose agent is gone, still on an older view a grace period after a commit: its view again.

    Checked on a member's own heartbeats, which it sends only once its agent is gone (a live agent's
    relay reached it); once per member and commit, so a member slow to adopt is not flooded.
    """

    def __init__(self, after: float) -> None:
        self._after = after
        self._epoch = 0
        self._due = float("inf")  # from when a member behind counts as having lost its copy
        self._sent: set[str] = set()  # members sent their copy again since the last commit

    def committed(self, epoch: int, now: float) -> None:
        self._epoch, self._due = epoch, now + self._after
        self._sent.clear()

    def check(self, now: float, member: str, epoch: int, send: Callable[[str, int], None]) -> None:
        """`member`'s own heartbeat reported `epoch`: past the grace and behind, it is sent its view again."""
        if now >= self._due and epoch < self._epoch and member not in self._sent:
            self._sent.add(member)
            send(member, epoch)
