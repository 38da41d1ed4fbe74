"""The coordinator's side of a host agent's heartbeats: ``HostHeartbeat`` and ``HeartbeatBatch``.

An agent forwards what its workers would have sent the coordinator themselves.
It may speak only for the members it registered in its ``AgentHello``; a fenced
member it still lists is told so and not vouched for.  A ``HostHeartbeat`` whose
member list and columns equal the agent's previous one costs one comparison, not
one update per member (:mod:`deadpool.coordinator.coverage` keeps who is covered);
changed columns are kept as sent and reach the members' records when something
reads them (:meth:`HostBeats.settle`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.records import Agent, MemberRecord
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import RejectReason
from deadpool.protocol.messages import Fenced, HeartbeatBatch, HostHeartbeat, Message


class HostBeats:
    """The host agents' word for their members: who is covered (:class:`Coverage`), and their progress columns."""

    def __init__(self, events: EventLog, views: Views, members: Mapping[str, MemberRecord],
                 agents: Mapping[str, Agent], fenced: Mapping[str, str], chaos: OperatorChaos, outbox: Outbox,
                 ask_to_rejoin: Callable[[str, str, float], None]) -> None:
        self.coverage = Coverage()  # members their host agent vouches for
        self._events = events
        self._views = views
        self._members = members
        self._agents = agents
        self._fenced = fenced
        self._chaos = chaos
        self._out = outbox
        self._ask_to_rejoin = ask_to_rejoin  # a member we cannot reach is alive: the service asks for its Join

    def _agent_of(self, message: HostHeartbeat | HeartbeatBatch, now: float) -> Agent | None:
        """The registered agent that sent `message` (heard at `now`), or None (rejected: unknown agent)."""
        agent = self._agents.get(message.sender)
        if agent is None:
            self._events.emit(schema.Rejected(reason="unknown_agent", peer=message.sender))
            return None
        agent.seen = now
        return agent

    def _speaks_for(self, agent: Agent, member: str) -> bool:
        """`agent` may speak for `member`: it started it. Rejected (and logged) otherwise."""
        if member in agent.members:
            return True
        self._events.emit(schema.Rejected(reason="not_agents_member", peer=agent.agent_id, detail=member))
        return False

    def host_heartbeat(self, message: HostHeartbeat, now: float) -> None:
        """Renew the agent's word for its members; keep its columns for their records (see :meth:`settle`)."""
        agent = self._agent_of(message, now)
        if agent is None or self.coverage.repeat(message.sender, now, message):  # checked the first time
            return
        computes = message.compute_s or [0.0] * len(message.members)
        columns = (message.epochs, message.steps, message.snapshot_steps, message.confirmed_steps,
                   message.stall_p99_s, computes)
        if not (len(message.members) == len(message.control_addrs) == len(message.epochs) == len(message.steps)
                == len(message.snapshot_steps) == len(message.confirmed_steps) == len(message.stall_p99_s)
                == len(computes)):
            self._events.emit(schema.Rejected(reason="bad_field", peer=message.sender,
                              detail="HostHeartbeat columns of different lengths"))
            return
        # The steady state: one comparison for the whole host (every member it lists is still vouched for; one
        # that is not, fenced or a stranger, takes the path below, which answers for it). The columns wait in the
        # batch for settle; a command armed for a step looks now.
        if self.coverage.renew(message.sender, now, message.members, columns, message):
            if self._chaos.armed:
                self.settle()
            return
        vouched: list[str] = []
        for i, member in enumerate(message.members):
            if not self._speaks_for(agent, member):
                continue
            record = self._members.get(member)
            if record is None or not record.control_addr:  # unknown (a restarted coordinator): ask for its Join
                self._ask_to_rejoin(member, message.control_addrs[i], now)
                if record is None:
                    continue
            if member in self._fenced:
                self._events.emit(schema.Rejected(reason=RejectReason.FENCED_PEER, peer=member, kind="HostHeartbeat"))
                self._out.send(record.control_addr, Fenced(member, self._views.epoch(), self._fenced[member]))
                continue
            vouched.append(member)
        self.coverage.cover(message.sender, now, message.members, columns, frozenset(vouched), message)

    def checks(self, message: HostHeartbeat) -> list[tuple[str, list[list[int]]]]:
        """The replica checks in `message` (its ``checks`` column) of the members its registered agent speaks for
        and that are not fenced: (member, its [epoch, step, checksum] triples)."""
        agent = self._agents.get(message.sender)
        if agent is None or not message.checks or len(message.checks) != len(message.members):
            return []
        return [(member, checks) for member, checks in zip(message.members, message.checks, strict=True)
                if checks and member in agent.members and member not in self._fenced]

    def settle(self) -> None:
        """The progress columns that agents sent since the last call, into their members' records.

        Nothing reads a member's step, snapshots or stall on the coordinator's own path, only status, metrics
        and armed chaos commands: keeping each host's newest columns, and copying them when asked, spares
        six field writes per member and step (about a third of a HostHeartbeat's cost at 131,072 members).
        A member heard from itself later than its agent's columns (its own heartbeat) keeps what it said; the
        columns wait for the agent's next message, which renews them.
        """
        records, fenced, coverage = self._members, self._fenced, self.coverage
        for agent in coverage.take_unsettled():
            batch = coverage.previous(agent)
            if batch is None:  # the agent fell silent and was forgotten since
                continue
            covered = batch.vouched
            for member, epoch, step, snapshot, confirmed, stall, compute in zip(batch.listed, *batch.columns,
                                                                                strict=True):
                record = records.get(member)
                if member not in covered or member in fenced or record is None:
                    continue
                if record.last_seen > batch.at:
                    coverage.unsettle(agent)  # looked at again once the agent's next message renews them
                    continue
                record.epoch, record.step, record.snapshot_step = epoch, step, snapshot
                record.confirmed_step, record.stall_p99_s, record.compute_s = confirmed, stall, compute
                if self._chaos.armed:
                    self._chaos.fire_armed(record)

    def relay(self, message: HeartbeatBatch, now: float, handle: Callable[[float, Message], None]) -> None:
        """Each member's heartbeat in an agent's batch, handled as if the member had sent it.

        A heartbeat vouches for a member's life, so only its own agent may forward it.
        """
        agent = self._agent_of(message, now)
        if agent is None:
            return
        for inner in message.beats:
            if self._speaks_for(agent, inner.sender):
                handle(now, inner)
