"""ComputeWatch: says where the training thread is when it leaves a coordinator's command waiting.

The training thread takes a Prepare, a view or a Stop at its next step boundary or
DeadPool wait, and a lost step gives it one at the next collective or gradient
hook, so a command waits a step at most.  One still untaken after the collective
timeout means the thread is held in the script's own code or a library's (a
DataLoader whose worker hangs, a lock): the peers' collectives and group builds
are timing out meanwhile.  The watch then writes, once per command, a
``compute_late`` event and a warning with the thread's Python stack, so the
cause is on record however the job ends.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import traceback

from deadpool.actors.handoff import Command, Handoff
from deadpool.events import schema
from deadpool.events.log import EventLog

log = logging.getLogger("deadpool.actors.watch")

STACK_FRAMES = 12  # the innermost frames of the stack a report carries


def stack_of(thread_id: int) -> str:
    """The innermost frames of thread `thread_id`'s Python stack ("" when it has ended)."""
    frame = sys._current_frames().get(thread_id)
    return "" if frame is None else "".join(traceback.format_stack(frame, limit=STACK_FRAMES))


class ComputeWatch:
    """Checks every `period` seconds whether the oldest untaken command has waited `late_after` seconds."""

    def __init__(self, handoff: Handoff, events: EventLog, compute_thread: int, late_after: float,
                 period: float = 1.0) -> None:
        self._handoff = handoff
        self._events = events
        self._compute_thread = compute_thread
        self._late_after = late_after
        self._period = period
        self._reported: Command | None = None  # the command last reported (each is reported once)

    async def run(self) -> None:
        """Until cancelled by the owner; nothing to set up or release."""
        while True:
            await asyncio.sleep(self._period)
            self.check(time.monotonic())

    def check(self, now: float) -> bool:
        """Report the oldest untaken command if it is late and not reported yet; True when it reported."""
        pending = self._handoff.untaken()
        if pending is None:
            return False
        command, since = pending
        waited = now - since
        if waited < self._late_after or command is self._reported:
            return False
        self._reported = command
        stack = stack_of(self._compute_thread)
        kind = type(command).__name__
        epoch = getattr(command, "epoch", -1)
        self._events.emit(schema.ComputeLate(command=kind, command_epoch=epoch, waited_s=round(waited, 1),
                          stack=stack))
        log.warning("deadpool: the training thread has not taken the coordinator's %s (epoch %d) for %.0fs; it "
                    "is here:\n%s", kind, epoch, waited, stack)
        return True
