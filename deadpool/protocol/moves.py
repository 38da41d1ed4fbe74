"""What a planned move says: the coordinator's order to leave, the moving seat's answers, and the hold it asks of
the other seats.

The coordinator tells the moving member to leave (``Leave``); the member answers at once with the step it will
leave after (``LeaveAt``), and the coordinator tells every other seat to hold at the end of that step
(``Hold``), so that they wait there for the view change instead of beginning the next step and abandoning it;
the spare reserved for the seat is told too (``Takeover``), and fetches the seat's state of that step as the seats
end it. Each seat says when it is there (``Holding``). Once its buddy confirmed its snapshot of the step, the
member says it stopped (``Leaving``); once every seat has ended the step, the view change starts, and the member
exits (once the parts of its snapshot the spare asked for have left).
"""

from __future__ import annotations

from deadpool.protocol.immutable import immutable


@immutable
class Leave:
    """The coordinator tells a seated member to hand its seat to a spare after the step it is in."""

    member: str  # the member that leaves
    epoch: int  # the coordinator's view when it asked
    reason: str  # why, for the member's last line
    term: int = 0  # the sending coordinator's term (older terms are dropped)


@immutable
class LeaveAt:
    """A member told to leave will stop after `step` (the step it is in, or the next one if it was between two or
    near the end of the one it is in)."""

    sender: str  # member id
    epoch: int  # the view it is in
    step: int  # the step it leaves after


@immutable
class Hold:
    """The coordinator tells a seat to wait at the end of `step` for the view change that moves `member` away."""

    member: str  # the member told
    epoch: int  # the coordinator's view when it asked
    step: int  # the step to hold after
    moving: str  # the member that leaves after that step
    term: int = 0  # the sending coordinator's term (older terms are dropped)


@immutable
class Takeover:
    """The coordinator tells the spare reserved for a move that it takes `moving`'s seat after `step`: it asks now
    for that step's snapshot of the seat (the moving member's own, and the other seats' slices), each answered once
    its seat has taken it, so that the state is there by the time the view change seats the spare."""

    member: str  # the spare told
    epoch: int  # the coordinator's view when it asked
    step: int  # the step the moving member leaves after
    moving: str  # the member that leaves the seat
    term: int = 0  # the sending coordinator's term (older terms are dropped)


@immutable
class Holding:
    """A seat told to hold ended `step` and waits there (or, told too late, had ended it and went on)."""

    sender: str  # member id
    epoch: int  # the view it is in
    step: int  # the step it ended


@immutable
class Leaving:
    """A member told to leave stopped after `step`, and its buddy confirmed its snapshot of that step."""

    sender: str  # member id
    epoch: int  # the view it stopped in
    step: int  # the last step it finished: the seat resumes after it
