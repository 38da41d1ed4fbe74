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
