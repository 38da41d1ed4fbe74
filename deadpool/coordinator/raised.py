"""An exception a training script raised, as the coordinator handles it: replace the member once, or stop.

The rule itself is the pure ``decisions.user_exception``; this applies it to the
coordinator's state (the exceptions reported so far, the view) and either
declares the member dead, as for a crash, or fails the job with the script's
own traceback.
"""

from __future__ import annotations

from typing import Any, Protocol

from deadpool.coordinator import decisions
from deadpool.coordinator.decisions import Raised, RaisedError
from deadpool.coordinator.records import MemberRecord
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import Role, UserException
from deadpool.protocol.view import View


class Coordinator(Protocol):
    """What the rule reads and calls of the coordinator (``service.Coordinator``)."""

    view: View | None
    members: dict[str, MemberRecord]
    events: EventLog
    outcome: tuple[bool, str] | None
    _raised: list[RaisedError]  # the scripts' exceptions reported so far (one per member at most)

    def _fail_job(self, reason: str, cause: str = "", **fields: Any) -> None: ...

    def _declare_dead(self, now: float, member: str, detected_by: str, detail: str) -> None: ...


def on_user_exception(c: Coordinator, report: UserException, now: float) -> None:
    """The script raised in `report.sender`: replace the member once, or stop the job (``user_exception``)."""
    if any(r.member == report.sender for r in c._raised) or c.outcome is not None:
        return
    seat = c.view.seat_of(report.sender) if c.view else c.members[report.sender].seat_hint  # -1: a spare
    raised = RaisedError(report.sender, -1 if seat is None else seat, report.step, report.kind)
    verdict, why = decisions.user_exception(c._raised, raised)
    if c.view is None and c.members[report.sender].role == Role.ACTIVE:
        verdict, why = Raised.STOP, f"{why}; but training has not started, so no spare can take the seat"
    c._raised.append(raised)
    c.events.emit(Event.USER_EXCEPTION, raised_by=report.sender, rank=raised.seat, step=report.step,
                  exception=report.kind, message=report.message, verdict=verdict, reason=why,
                  traceback=report.traceback)
    if verdict is Raised.STOP:
        message = report.message.splitlines()[0][:300] if report.message else ""
        c._fail_job(
            f"{report.kind}: {message}. {why}. Stopped at once, the remaining spares unused; fix the script "
            "(its traceback is in the launcher's summary and the job_failed event) and relaunch.",
            cause="user_error", exception=report.kind, step=report.step, raised_by=report.sender,
            rank=raised.seat, traceback=report.traceback)
        return
    c._declare_dead(now, report.sender, "exception", f"raised {report.kind} at step {report.step}")
