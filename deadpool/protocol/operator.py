"""What an operator tool sends the coordinator and what it answers: status, chaos and planned moves.

Each request names the tool's own endpoint (``reply_to``) and a ``nonce`` the answer echoes
(``tools/request.py``); the coordinator handles them by kind, not as a member's own messages.
"""

from __future__ import annotations

from deadpool.protocol.immutable import immutable


@immutable
class StatusRequest:
    """Asks the coordinator for the live view and member table (operator tools)."""

    reply_to: str  # control address of the asker
    nonce: int  # echoed in the reply


@immutable
class StatusReply:
    """The coordinator's live state, encoded as JSON text for operator tools."""

    nonce: int  # echoed from the request
    json: str  # JSON document (view, members, recent events)


@immutable
class ChaosCommand:
    """An operator asks the coordinator to inject a failure into a member."""

    action: str  # kill, stop or cont
    seat: int  # target seat, or -1 when member is given
    member: str  # target member id, or "" when seat is given
    at_step: int  # fire when the target finishes this step; -1 for now
    reply_to: str  # control address for the ChaosResult
    nonce: int  # echoed in the result


@immutable
class ChaosResult:
    """The coordinator's answer to a ChaosCommand."""

    nonce: int  # echoed from the command
    ok: bool  # whether the action was armed or done
    detail: str  # what happened, for the operator


@immutable
class MoveCommand:
    """An operator asks for planned moves: one seat (`seat` or `member`) to a spare, or every seat of `host`."""

    seat: int  # the seat to move, -1 when member or host is given
    member: str  # the member to move, "" when seat or host is given
    spare: str  # the spare to take the seat ("": the coordinator chooses); a single move only
    host: str  # drain this host: its seats move to spares elsewhere, its spares leave ("": a single move)
    reason: str  # why, for the events and the moved member's last line (an operator, a preemption notice)
    reply_to: str  # control address for the MoveResult
    nonce: int  # echoed in the result


@immutable
class MoveResult:
    """The coordinator's answer to a MoveCommand: started, or refused and why."""

    nonce: int  # echoed from the command
    ok: bool  # whether the moves started
    detail: str  # what happens, or why not
    missing: int = 0  # spares missing for the moves asked (refused for that)
