"""What an audit says: the coordinator's order to re-do one seat's step, and the digests the seat and a spare send.

With ``deadpool launch --audit`` one seat a step, in turn, digests its local gradients before their
reduction; an idle spare re-does such a step from that seat's snapshot of the step before and digests
the same; the coordinator compares the two (``coordinator/audits.py``).
"""

from __future__ import annotations

from deadpool.protocol.immutable import immutable


def audited_seat(step: int, world: int) -> int:
    """The seat whose local gradients of `step` are digested (sent as an ``AuditDigest``): each in turn."""
    return step % world


@immutable
class Audit:
    """The coordinator asks a spare to re-do `seat`'s `step` from the seat's snapshot of the step before, and to
    digest the local gradients as the seat did (``audited_seat``)."""

    member: str  # the spare told
    epoch: int  # the coordinator's view when it asked
    seat: int  # the seat audited
    step: int  # the step audited
    term: int = 0  # the sending coordinator's term (older terms are dropped)


@immutable
class AuditDigest:
    """A member's checksum of one seat's local gradients of an audited step, before their reduction: the seat's own,
    or the spare's re-done ones."""

    sender: str  # member id
    epoch: int  # the view the digest was taken under (the spare's: the newest it held)
    seat: int  # the seat audited
    step: int  # the step audited
    digest: int  # the checksum of the seat's gradient buckets in order (``snapshot/checksum.py``); 0 with `missed`
    missed: str = ""  # why there is no digest (the step was lost, no snapshot to re-do it from); "": there is one
