"""Operator chaos through the coordinator: ``deadpool chaos`` asks, the target's host agent signals.

A command names a member or a seat and an action (kill, stop, cont), now or when the
target finishes a step; the coordinator checks it, answers the operator, and has the
agent that started the target deliver the real signal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from deadpool.chaos import OPERATOR_ACTIONS, ChaosAction
from deadpool.coordinator.records import Agent, MemberRecord
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import ChaosCommand, ChaosResult, Message, SignalMember
from deadpool.protocol.view import View


class Coordinator(Protocol):
    """What the relay reads and uses of the coordinator (``service.Coordinator``)."""

    view: View | None
    members: dict[str, MemberRecord]
    agents: dict[str, Agent]
    events: EventLog
    wall: Callable[[], float]

    def send(self, addr: str, message: Message) -> None: ...


@dataclass
class OperatorChaos:
    """The commands armed for a later step, and when each injected failure happened."""

    armed: list[tuple[ChaosCommand, str]] = field(default_factory=list)  # (command, target) waiting for a step
    injected_at: dict[str, float] = field(default_factory=dict)  # member -> wall clock of its injected failure
    injected_step: dict[str, int] = field(default_factory=dict)  # member -> the step its --chaos spec fired at

    def failure_step(self, members: Iterable[str]) -> int:
        """The latest step a --chaos spec of one of `members` fired at; -1 when none did."""
        return max((self.injected_step.get(member, -1) for member in members), default=-1)

    def command(self, c: Coordinator, command: ChaosCommand) -> None:
        """An operator's kill/stop/cont: carried out by the target's host agent, logged as an event."""
        view = c.view
        target = command.member
        if not target and view is not None and 0 <= command.seat < view.world_size:
            target = view.seats[command.seat]
        if command.action not in OPERATOR_ACTIONS:
            detail = f"unknown action {command.action!r}: use kill, stop or cont"
        elif not target or target not in c.members:
            detail = f"no such member or seat (member={command.member!r}, rank={command.seat})"
        elif not any(target in agent.members for agent in c.agents.values()):
            detail = f"no agent owns {target}: it was not started by a `deadpool launch` this coordinator knows"
        else:
            detail = ""
        if detail:
            c.send(command.reply_to, ChaosResult(command.nonce, False, detail))
            return
        if command.at_step >= 0 and c.members[target].step < command.at_step:
            self.armed.append((command, target))
            c.send(command.reply_to, ChaosResult(
                command.nonce, True, f"armed: {command.action} {target} when it finishes step {command.at_step}"))
            return
        self._signal(c, command, target)
        c.send(command.reply_to, ChaosResult(command.nonce, True, f"{command.action} sent to {target}"))

    def fire_armed(self, c: Coordinator, record: MemberRecord) -> None:
        for command, target in [item for item in self.armed if item[1] == record.member]:
            if record.step >= command.at_step:
                self.armed.remove((command, target))
                self._signal(c, command, target)

    def _signal(self, c: Coordinator, command: ChaosCommand, target: str) -> None:
        seat = c.view.seat_of(target) if c.view else None
        if command.action == ChaosAction.KILL:
            self.injected_at[target] = c.wall()
        c.events.emit(Event.CHAOS_INJECTED, action=command.action, target_member=target,
                         target_rank=-1 if seat is None else seat, at_step=command.at_step,
                         target_step=c.members[target].step, via="operator")
        for agent in c.agents.values():
            if target in agent.members:
                c.send(agent.control_addr, SignalMember(target, command.action, "operator chaos"))
