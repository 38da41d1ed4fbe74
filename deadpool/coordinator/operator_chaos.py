"""Operator chaos through the coordinator: ``deadpool chaos`` asks, the target's host agent signals.

A command names a member or a seat and an action (kill, stop, cont), now or when the
target finishes a step; the coordinator checks it, answers the operator, and has the
agent that started the target deliver the real signal.  It also keeps when each
injected failure happened (an operator's kill, or a worker's own ``--chaos`` spec),
which a death's detection time is measured from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from deadpool.chaos import OPERATOR_ACTIONS, ChaosAction
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.records import Agent, MemberRecord
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import ChaosVia
from deadpool.protocol.messages import ChaosCommand, ChaosInjected, ChaosResult, SignalMember


class OperatorChaos:
    """The commands armed for a later step, and when each injected failure happened."""

    def __init__(self, events: EventLog, views: Views, members: Mapping[str, MemberRecord],
                 agents: Mapping[str, Agent], outbox: Outbox, wall: Callable[[], float]) -> None:
        self._events = events
        self._views = views
        self._members = members
        self._agents = agents
        self._out = outbox
        self._wall = wall
        self._armed: list[tuple[ChaosCommand, str]] = []  # (command, target) waiting for a step
        self._injected_at: dict[str, float] = {}  # member -> wall clock of its injected failure
        self._injected_step: dict[str, int] = {}  # member -> the step its --chaos spec fired at

    @property
    def armed(self) -> bool:
        """Some command waits for its target to finish a step."""
        return bool(self._armed)

    def injected_at(self, member: str) -> float | None:
        """The wall clock of `member`'s injected failure (None: none was injected)."""
        return self._injected_at.get(member)

    def failure_step(self, members: Iterable[str]) -> int:
        """The latest step a --chaos spec of one of `members` fired at; -1 when none did."""
        return max((self._injected_step.get(member, -1) for member in members), default=-1)

    def injected(self, report: ChaosInjected) -> None:
        """A member's own --chaos spec fired: when, and at which step."""
        self._injected_at[report.sender] = report.ts
        self._injected_step[report.sender] = report.step

    def command(self, command: ChaosCommand) -> None:
        """An operator's kill/stop/cont: carried out by the target's host agent, logged as an event."""
        view = self._views.current
        target = command.member
        if not target and view is not None and 0 <= command.seat < view.world_size:
            target = view.seats[command.seat]
        if command.action not in OPERATOR_ACTIONS:
            detail = f"unknown action {command.action!r}: use kill, stop or cont"
        elif not target or target not in self._members:
            detail = f"no such member or seat (member={command.member!r}, rank={command.seat})"
        elif not any(target in agent.members for agent in self._agents.values()):
            detail = f"no agent owns {target}: it was not started by a `deadpool launch` this coordinator knows"
        else:
            detail = ""
        if detail:
            self._out.send(command.reply_to, ChaosResult(command.nonce, False, detail))
            return
        if command.at_step >= 0 and self._members[target].step < command.at_step:
            self._armed.append((command, target))
            self._out.send(command.reply_to, ChaosResult(
                command.nonce, True, f"armed: {command.action} {target} when it finishes step {command.at_step}"))
            return
        self._signal(command, target)
        self._out.send(command.reply_to, ChaosResult(command.nonce, True, f"{command.action} sent to {target}"))

    def fire_armed(self, record: MemberRecord) -> None:
        """`record`'s member reported a step: the commands armed for it fire once it reached their step."""
        for command, target in [item for item in self._armed if item[1] == record.member]:
            if record.step >= command.at_step:
                self._armed.remove((command, target))
                self._signal(command, target)

    def _signal(self, command: ChaosCommand, target: str) -> None:
        view = self._views.current
        seat = view.seat_of(target) if view else None
        if command.action == ChaosAction.KILL:
            self._injected_at[target] = self._wall()
        self._events.emit(schema.ChaosInjected(action=ChaosAction(command.action), target_member=target,
                          target_rank=-1 if seat is None else seat, at_step=command.at_step,
                          target_step=self._members[target].step, via=ChaosVia.OPERATOR))
        for agent in self._agents.values():
            if target in agent.members:
                self._out.send(agent.control_addr, SignalMember(target, command.action, "operator chaos"))
