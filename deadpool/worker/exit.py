"""How a worker process ends: the exit guard, the uncaught-exception hook, and the fenced exit.

Exit is process-wide (``atexit``, ``sys.excepthook``, ``os._exit``), so its state
is one object per process, ``GUARD``, owned by this module: the runtime arms it,
hands it the process groups it sets aside, and marks it finished.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import Fenced

FENCED_STATUS = 3  # exit status of a member that was declared dead and replaced


class ExitGuard:
    """At exit, skip the destructors of process groups and the interpreter's teardown.

    Gloo aborts the process when a group whose op was abandoned is destructed,
    and a group whose peers died can block the interpreter's exit.  After
    ``rt.finish()`` (a released spare too) nothing of DeadPool's is left to clean
    up, while tearing down torch's modules takes 1-2 s on a busy host, which the
    launcher and the job's wall time would wait for.  So when groups were
    retired, the runtime finished, or the script ended with an uncaught
    exception, the process ends here with the status Python would have used (1
    after an uncaught exception); other processes exit normally.
    """

    def __init__(self) -> None:
        self.status = 0  # the exit status: 1 once an uncaught exception reached the excepthook
        self.finished = False  # rt.finish() ran: nothing of DeadPool's is left for the interpreter's teardown
        self._retired: list[Any] = []  # groups and store clients are never destroyed (that can block or abort)
        self._stop: Callable[[], None] | None = None  # ends the live runtime's thread at exit
        self._installed = False

    def arm(self, stop: Callable[[], None]) -> None:
        """Guard this process's exit; `stop` ends the runtime thread if the runtime is still live then."""
        self._stop = stop
        if self._installed:
            return
        self._installed = True
        atexit.register(self.at_exit)
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            self.status = 1
            previous(kind, value, tb)

        sys.excepthook = hook

    def retire(self, obj: Any) -> None:
        """Keep a process group (or store client) referenced until the process ends."""
        self._retired.append(obj)

    def finish(self) -> None:
        """The runtime shut down: at exit there is no thread to stop and nothing to tear down."""
        self._stop = None
        self.finished = True

    def at_exit(self) -> None:
        if not self._retired and self.status == 0 and not self.finished:
            return
        if self._stop is not None:
            self._stop()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(self.status)


GUARD = ExitGuard()


def exit_fenced(events: EventLog, member: str, command: Fenced) -> NoReturn:
    """A fenced member leaves at once, touching nothing shared (no snapshot, no store, no peers)."""
    message = (
        f"deadpool: member {member} was declared dead at epoch {command.epoch} ({command.reason}) "
        "and its seat was given to another member. This process changed nothing after that and exits now; "
        "the job goes on without it."
    )
    events.emit(Event.FENCED_EXIT, reason=command.reason)
    print(message, file=sys.stderr, flush=True)
    os._exit(FENCED_STATUS)
