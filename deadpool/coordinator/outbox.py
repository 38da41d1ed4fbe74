"""What one call of the coordinator sends: the queue that ``handle`` and ``tick`` return, and the time of the call.

Every piece of the coordinator that sends (views, rounds, deaths, host beats, operator chaos, the job's
end) queues here: a message to one address, stamped with this coordinator's term, or a broadcast that
:mod:`~deadpool.coordinator.fanout` plans through the host agents.  The service sets :attr:`Outbox.now`
when a call begins; a broadcast judges which agents were heard recently by it, and so do the pieces
that ask whether the lease holds at this call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deadpool.coordinator.fanout import Fanout, Plan
from deadpool.coordinator.pools import Addresses
from deadpool.coordinator.records import Agent, Send
from deadpool.coordinator.terms import Terms
from deadpool.protocol.messages import Message


class Outbox:
    """The sends queued by the call in progress, drained by the service when the call returns."""

    def __init__(self, terms: Terms, fanout: Fanout, addrs: Addresses, agents: Mapping[str, Agent],
                 now: float) -> None:
        self._terms = terms
        self._fanout = fanout
        self._addrs = addrs
        self._agents = agents
        self._sends: list[Send] = []
        self.now = now  # the time of the call in progress (the service sets it)

    def send(self, addr: str, message: Message) -> None:
        """Queue `message` for `addr` (stamped with this term)."""
        if addr:  # "": a member known only from a reported view has not re-joined yet
            self._sends.append(Send(addr, self._terms.stamp(message)))

    def send_again(self, addr: str, message: Message) -> None:
        """Queue `message`, sent as this very object before while it holds: its frame may be kept (``Send.again``)."""
        self._sends.append(Send(addr, message, None, True))

    def broadcast(self, members: list[str], *messages: Message, relay: bool = True) -> Plan:
        """Each message object to every recipient (encoded once), through their host agents where heard (fanout.py)."""
        plan = self._fanout.plan(members, self._addrs.control, self._agents, self.now, self._terms.term, relay)
        for message in messages:  # a whole view's pieces share one plan
            self._sends += plan.sends(self._terms.stamp(message))
        return plan

    def extend(self, sends: Iterable[Send]) -> None:
        """Queue sends planned elsewhere (a Prepare resent directly)."""
        self._sends += sends

    def drain(self) -> list[Send]:
        """What the call queued; the queue starts empty again."""
        sends, self._sends = self._sends, []
        return sends
