"""Checksums of the replicated state: what the seats compare to find a replica that silently diverged.

State that is the same on every seat (``rt.ddp``'s parameters and a plain optimizer's state for them, the
snapshot's replicated region) must stay bitwise equal on every seat. Each snapshot's copy thread sums one
part of that region, the same part on every seat (part ``capture index % parts``, so all of it every
``parts`` snapshots), as 64-bit little-endian words modulo 2**64, tensor by tensor. A flipped bit changes
the sum by a power of two, never by zero, so one flip is always seen; a wrong value of any other kind
slips through with a chance of 2**-64. The sum reads memory once (numpy's reduction releases the GIL);
it is not a cryptographic hash and needs not be: the replicas are not adversaries. Why the seats compare
sums rather than exchange tensors is argued in ``docs/design/corruption.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deadpool.snapshot.statetree import Manifest

__all__ = ["checksum", "part_ranges"]

_MASK = (1 << 64) - 1
_MIX = 0x100000001B3  # the FNV prime: pieces are combined in order, so moving bytes between tensors is seen


def part_ranges(manifest: Manifest, part: int, parts: int) -> list[tuple[int, int, int]]:
    """The byte ranges (tensor index, begin, end within the tensor) of part `part` of `parts` of the manifest's
    replicated region, in arena order. The region is cut at multiples of 8 bytes; tensors' padding is left out."""
    size = manifest.replicated
    if not size or parts < 1:
        return []
    start = manifest.replicated_at
    per = (-(-size // parts) + 7) // 8 * 8 if parts > 1 else size  # ceil(size / parts), rounded up to 8 bytes
    lo, hi = start + part * per, min(start + (part + 1) * per, start + size)
    ranges = []
    for index, spec in enumerate(manifest.tensors):
        begin, end = max(spec.offset, lo), min(spec.offset + spec.nbytes, hi)
        if begin < end and spec.offset >= start:
            ranges.append((index, begin - spec.offset, end - spec.offset))
    return ranges


def checksum(pieces: list[np.ndarray[Any, Any]]) -> int:
    """The sum of each uint8 piece's 64-bit words (and its last bytes), combined in order (an unsigned 64-bit
    integer, the same on every seat for the same bytes)."""
    total = 0
    for piece in pieces:
        whole = piece.size // 8 * 8
        words = int(np.add.reduce(piece[:whole].view(np.uint64), dtype=np.uint64)) if whole else 0
        tail = int.from_bytes(piece[whole:].tobytes(), "little")
        total = (total * _MIX + words + tail + piece.size) & _MASK
    return total
