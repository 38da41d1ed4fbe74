"""The standby coordinator: it watches the active one and takes over, with a higher term, when it is lost.

Sans-I/O like the coordinator (``handle``/``tick`` return what to send).  While the
active answers its StandbyHello, the standby only listens: members' heartbeats and
agents' hellos tell it who is alive and where, so that a takeover can reach them
all.  When the active has been silent for the takeover bound, it asks every host's
agent whether it hears the active either, and takes over only when a majority of the
hosts confirm (``decisions.takeover``); ``hand_over`` then makes the recovering
``Coordinator`` of the next term on this process's own address and store, which
``main.py`` serves, telling everyone the new term first.
"""

from __future__ import annotations

import json
import logging

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.records import Agent, Send
from deadpool.coordinator.service import Coordinator
from deadpool.coordinator.terms import Terms, takeover_bound
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import (
    AgentHello,
    Coordinators,
    Finished,
    Heartbeat,
    Message,
    SilenceQuery,
    SilenceReport,
    StandbyHello,
    StatusReply,
    StatusRequest,
    Stop,
)

log = logging.getLogger("deadpool.coordinator.standby")

QUERY_WAIT_S = 0.5  # agents' answers to a SilenceQuery are counted after this (or when all answered)
QUERY_EVERY_S = 1.0  # a query that did not decide is repeated this often while the active stays silent


class Standby:
    """A standby coordinator's state: the active it watches, the members and agents it heard."""

    def __init__(self, config: Config, address: str, store: str, active: str, hosts: int, events: EventLog,
                 started: float) -> None:
        self.address, self.store, self.active, self.hosts = address, store, active, hosts
        self.events = events
        self._interval = config.heartbeat_interval
        self._failure_timeout = config.failure_timeout
        self.bound = takeover_bound(config.failure_timeout)
        self.term = 0  # the active's term, learned from its first answer (0: never heard it)
        self.members: dict[str, str] = {}  # member -> control address (from its heartbeats)
        self.seen: dict[str, float] = {}  # member -> when its newest heartbeat arrived
        self.agents: dict[str, str] = {}  # agent -> control address (from its hellos)
        self.finished: dict[str, Finished] = {}  # member -> its seat's Finished (it may exit before a takeover)
        self.active_seen = started
        self._hello_at = -1e9
        self._nonce = 0
        self._query_at: float | None = None
        self._reports: dict[str, float] = {}
        self._declined = False  # this silence's takeover_declined was emitted
        self.took_over = ""  # why it takes over ("" while it stands by)
        self.ended: tuple[bool, str] | None = None  # the job's end, told by the active (Stop)
        self._outbox: list[Send] = []

    @property
    def outcome(self) -> tuple[bool, str] | None:
        """Not None once this standby's part is over: it takes over, or the job ended."""
        if self.took_over:
            return True, self.took_over
        return self.ended

    def handle(self, now: float, message: Message) -> list[Send]:
        if isinstance(message, Coordinators):
            self._on_coordinators(now, message)
        elif isinstance(message, Heartbeat):
            if message.control_addr:
                self.members[message.sender] = message.control_addr
                self.seen[message.sender] = now
        elif isinstance(message, Finished):
            self.finished[message.sender] = message  # handed to the next term's coordinator
        elif isinstance(message, AgentHello):
            self.agents[message.sender] = message.control_addr
        elif isinstance(message, SilenceReport):
            if self._query_at is not None and message.nonce == self._nonce:
                self._reports[message.sender] = message.silent_s
        elif isinstance(message, Stop):
            if message.term >= self.term:
                self.ended = (message.ok, message.reason)
        elif isinstance(message, StatusRequest):
            self._send(message.reply_to, StatusReply(message.nonce, json.dumps(self.status(now))))
        else:
            self.events.emit(schema.Rejected(reason="unexpected_type", detail=f"{type(message).__name__} at a standby"))
        return self._drain()

    def tick(self, now: float) -> list[Send]:
        if now - self._hello_at >= self._interval:
            self._hello_at = now
            self._send(self.active, StandbyHello(self.address, self.term))
        silent = now - self.active_seen
        if silent < self.bound or not self.term:
            self._query_at, self._declined = None, False  # not silent, or never heard: nothing to take over
            return self._drain()
        if self._query_at is None or now - self._query_at >= QUERY_EVERY_S:
            self._nonce += 1
            self._query_at, self._reports = now, {}
            for addr in self.agents.values():
                self._send(addr, SilenceQuery(self.address, self._nonce, self.term))
        elif now - self._query_at >= QUERY_WAIT_S or len(self._reports) >= len(self.agents):
            decided, why = decisions.takeover(silent, self.bound, self._reports, self.hosts)
            if decided:
                self.took_over = why
                self.events.emit(schema.Takeover(term=self.term + 1, old_active=self.active,
                                 silent_s=round(silent, 3), confirmed_by=sorted(self._reports), reason=why))
            else:
                if not self._declined:  # once per silence: it may last long (a cut between two hosts only)
                    self._declined = True
                    self.events.emit(schema.TakeoverDeclined(term=self.term, silent_s=round(silent, 3),
                                     reports={a: round(s, 3) for a, s in self._reports.items()}, reason=why))
                self._query_at = now - QUERY_EVERY_S + QUERY_WAIT_S  # ask again soon
        return self._drain()

    def hand_over(self, config: Config, world_size: int, now: float) -> tuple[Coordinator, list[Send]]:
        """The coordinator of the next term, on this process's address and store, and what it sends first.

        It learns the view from the members, as a restarted coordinator does; from this standby it gets
        what it cannot learn from them in time: the agents (to tell the job's end), the seats that already
        reported their end (a seat exits right after), and how long each member had been silent here.
        It tells every member, agent and the old active the new term, and the old active until it is gone.
        """
        terms = Terms(self.term + 1, self.address, self.store, self.hosts, self._failure_timeout)
        terms.supersede(now, self.active)
        coordinator = Coordinator(config, world_size, self.store, self.events, started=now, recovering=True,
                                  terms=terms)
        coordinator.handed_finished = list(self.finished.values())
        coordinator.handed_silence = {member: now - seen for member, seen in self.seen.items()}
        coordinator.agents.update({agent: Agent(agent, "", addr, seen=now) for agent, addr in self.agents.items()})
        message = terms.coordinators()
        addrs = dict.fromkeys([*self.members.values(), *self.agents.values(), self.active])
        return coordinator, [Send(addr, message) for addr in addrs if addr]

    def status(self, now: float) -> dict[str, object]:
        return {"role": "standby", "term": self.term, "active": self.active, "standby": self.address,
                "active_silent_s": round(now - self.active_seen, 3), "takeover_bound_s": self.bound,
                "members_heard": len(self.members), "agents_heard": len(self.agents)}

    def _on_coordinators(self, now: float, message: Coordinators) -> None:
        if message.term < self.term:
            self.events.emit(schema.Rejected(reason="stale_term", kind="Coordinators",
                             detail=f"term {message.term} < {self.term}"))
            return
        if message.active != self.active:
            log.info("following the coordinator of term %d at %s", message.term, message.active)
            self.active = message.active
        self.term = message.term
        self.active_seen = now

    def _send(self, addr: str, message: Message) -> None:
        self._outbox.append(Send(addr, message))

    def _drain(self) -> list[Send]:
        sends, self._outbox = self._outbox, []
        return sends
