"""DeadPool's few error types, named by who is at fault.

Every message says what happened, what was kept safe, and what to do next.
Background errors (from the runtime thread) are latched and raised on the
compute thread at the next step boundary, chained to the original traceback.
"""

from __future__ import annotations


class DeadPoolError(Exception):
    """Base class of every error DeadPool raises."""


class MisuseError(DeadPoolError):
    """The caller used the API wrongly (bad argument, wrong order of calls)."""


class PeerFailure(DeadPoolError):
    """A peer failed in a way the job cannot recover from (no spare, lost snapshot)."""


class WaitTimeout(DeadPoolError):
    """A bounded wait expired; the message names the wait and its bound."""


class FencedError(DeadPoolError):
    """This member was declared dead and replaced; it must exit without touching anything."""


class JobStopped(DeadPoolError):
    """The coordinator stopped the job (another member's failure could not be recovered)."""


class CollectiveAborted(DeadPoolError):
    """Internal: a collective was abandoned and the step is poisoned.

    ``interrupted`` is True when a newer view asked the member to stop (a Prepare), False when the
    collective itself failed (a peer died, the group timed out).
    """

    def __init__(self, what: str, cause: str, interrupted: bool = False) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what
        self.cause = cause
        self.interrupted = interrupted


class RestoreFailed(PeerFailure):
    """A seat's snapshot could not be restored from where the view said it is (buddy, disk, local)."""


class ActorStopped(DeadPoolError):
    """The actor that held a pending request stopped (shutdown) before answering it."""
