"""How a worker process ends: the exit guard, the uncaught-exception hook and its report, the fenced exit.

Exit is process-wide (``atexit``, ``sys.excepthook``, ``os._exit``), so its state
is one object per process, ``GUARD``, owned by this module: the runtime arms it
(with the report an exception of the script sends to the coordinator), hands it
the process groups it sets aside, and marks it finished.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

from deadpool.actors.handoff import Handoff
from deadpool.errors import DeadPoolError, JobStopped, MisuseError
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import TRACEBACK_LIMIT, Fenced, UserException
from deadpool.worker.step import StepState

FENCED_STATUS = 3  # exit status of a member that was declared dead and replaced
REPORT_WAIT_S = 5.0  # how long a raising worker waits for the coordinator's answer to its report
MESSAGE_LIMIT = 2000  # characters of str(exception) a report carries

Reporter = Callable[[type[BaseException], BaseException, TracebackType | None], None]


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
        self._report: Reporter | None = None  # tells the coordinator of the script's exception
        self._early: Callable[[], str] | None = None  # why the process leaves its seat before its loop ended
        self._installed = False

    def arm(self, stop: Callable[[], None], report: Reporter | None = None,
            early: Callable[[], str] | None = None) -> None:
        """Guard this process's exit; `stop` ends the runtime thread if the runtime is still live then.

        `report` is called with an uncaught exception of the script's own (see `is_user_error`)
        after its traceback was printed, before the process exits.  `early` says why a process that
        ends without an exception (``sys.exit``, a ``return`` out of the loop) leaves its seat
        before its loop ended ("": it does not); that is reported as the script's error and the
        process exits with status 1, so the job learns it at once, not from the missing heartbeats.
        """
        self._stop = stop
        self._report = report
        self._early = early
        if self._installed:
            return
        self._installed = True
        atexit.register(self.at_exit)
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            self.status = 1
            if isinstance(value, JobStopped):
                # The coordinator ended the job for a reason of its own (it is in the launcher's summary):
                # one line per survivor, not a traceback through the training loop.
                first = str(value).splitlines()[0] if str(value) else "(no reason given)"
                print(f"deadpool: job stopped: {first}", file=sys.stderr, flush=True)
                return
            previous(kind, value, tb)
            if self._report is not None and is_user_error(value):
                sys.stderr.flush()
                try:
                    self._report(kind, value, tb)
                except Exception as err:  # the process is ending anyway: say so, and exit with status 1
                    print(f"deadpool: could not report the exception to the coordinator: {err!r}",
                          file=sys.stderr, flush=True)

        sys.excepthook = hook

    def retire(self, obj: Any) -> None:
        """Keep a process group (or store client) referenced until the process ends."""
        self._retired.append(obj)

    def finish(self) -> None:
        """The runtime shut down: at exit there is no thread to stop and nothing to tear down."""
        self._stop = None
        self.finished = True

    def at_exit(self) -> None:
        if self.status == 0 and not self.finished and self._early is not None and (why := self._early()):
            self.status = 1
            print(f"deadpool: {why}", file=sys.stderr, flush=True)
            if self._report is not None:
                self._report(MisuseError, MisuseError(why), None)
        if not self._retired and self.status == 0 and not self.finished:
            return
        if self._stop is not None:
            self._stop()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(self.status)


GUARD = ExitGuard()


def is_user_error(value: BaseException) -> bool:
    """Whether an uncaught exception is the training script's own, to be reported to the coordinator.

    DeadPool's own errors are not: a peer's failure, a timeout, a stopped job or a fence are
    known to the coordinator already (a collective that failed because a peer died poisons the
    step inside DeadPool and never reaches the script).  A misuse of the API is the script's.
    ``KeyboardInterrupt`` is the operator's.
    """
    if isinstance(value, KeyboardInterrupt):
        return False
    return isinstance(value, MisuseError) or not isinstance(value, DeadPoolError)


def bounded_traceback(kind: type[BaseException], value: BaseException, tb: TracebackType | None,
                      limit: int = TRACEBACK_LIMIT) -> str:
    """The formatted traceback, at most `limit` bytes of UTF-8: its end (where the exception was raised)."""
    text = "".join(traceback.format_exception(kind, value, tb))
    data = text.encode()
    if len(data) <= limit:
        return text
    marker = f"[... {len(data) - limit} bytes of the traceback left out ...]\n"
    return marker + data[len(data) - limit + len(marker.encode()):].decode(errors="ignore")


class ExceptionReport:
    """The report of a script's exception (a ``UserException``), sent before the process exits.

    It is sent through the runtime thread, and the worker waits (at most `wait_s`) for the
    coordinator's answer: a ``Fenced`` (the member is replaced) or a ``Stop`` (the job ends).
    That answer is what shows the report arrived before the exit, which the coordinator then
    no longer needs to detect.
    """

    def __init__(self, handoff: Handoff, member: str, state: StepState, wait_s: float = REPORT_WAIT_S) -> None:
        self._handoff = handoff
        self._member = member
        self._state = state
        self._wait_s = wait_s

    def __call__(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        state = self._state
        module = kind.__module__
        name = kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"
        report = UserException(self._member, state.epoch, state.rank, state.step, name, str(value)[:MESSAGE_LIMIT],
                               bounded_traceback(kind, value, tb))
        handoff = self._handoff
        try:
            handoff.post(report)
        except RuntimeError:
            return  # the runtime already stopped (after rt.finish()): nobody to tell
        print(f"deadpool: reported {name} at step {state.step} to the coordinator", file=sys.stderr, flush=True)
        handoff.wait_terminal(self._wait_s)


def exit_moved(events: EventLog, member: str, rank: int, step: int, reason: str) -> NoReturn:
    """A moved member's seat is a spare's now: it says so and exits 0, touching nothing shared."""
    events.emit(schema.MovedExit(step=step, reason=reason))
    print(f"deadpool: rank {rank} ({member}) was moved ({reason}): it stopped after step {step}, its buddy holds "
          "that snapshot for the spare that takes the seat, and this process exits 0", file=sys.stderr, flush=True)
    os._exit(0)


def exit_fenced(events: EventLog, member: str, command: Fenced) -> NoReturn:
    """A fenced member leaves at once, touching nothing shared (no snapshot, no store, no peers)."""
    message = (
        f"deadpool: member {member} was declared dead at epoch {command.epoch} ({command.reason}) "
        "and its seat was given to another member. This process changed nothing after that and exits now; "
        "the job goes on without it."
    )
    events.emit(schema.FencedExit(reason=command.reason))
    print(message, file=sys.stderr, flush=True)
    os._exit(FENCED_STATUS)
