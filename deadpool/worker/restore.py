"""How an adopting seat gets its state back: one plan per restore source.

``recovery.py`` chooses the plan when it adopts a view (the view names the seat's source,
and what this member still holds decides the rest), and runs it in two phases around
building the seat's groups.  A state that is whole already (this member's own snapshot,
or a reserved spare's prefetch) is loaded before the groups form, while the peers still
set up; its RNG states are put back once the groups are built, since building them may
draw from the RNGs.  Any other state (the buddy's copy, a snapshot completed with the
peers' slices of the replicated region, a disk checkpoint) is loaded after the groups,
for the same reason.  The source is the ``restored`` event's ``source``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from deadpool.errors import RestoreFailed
from deadpool.events.vocabulary import RestoreSource as Source
from deadpool.protocol.view import View
from deadpool.snapshot.checkpoint import load as checkpoint_load
from deadpool.snapshot.statetree import Manifest, replicated_slice
from deadpool.snapshot.store import Slot
from deadpool.worker import rng as rng_mod
from deadpool.worker.fetch import Asked, Restored
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.tracked import TrackedState


@dataclass(frozen=True)
class Preloaded:
    """A reserved spare's state, loaded from its prefetch while the survivors finish their step."""

    seat: int
    step: int  # the step the state is of (the adoption keeps it if the view resumes from it)
    asked: list[Asked]  # where its parts came from
    rng: Any  # the snapshot's RNG states: restored again once the groups are built (building may draw)
    nbytes: int


class Plan(abc.ABC):
    """One adoption's restore: what it loads before the seat's groups form, and what after."""

    source: ClassVar[Source]

    def __init__(self, held: Slot | None = None, kept: dict[int, torch.Tensor] | None = None) -> None:
        self.held = held  # the local snapshot restored from: kept for peers asking for its slice
        self.kept: dict[int, torch.Tensor] = kept if kept is not None else {}  # live tensors holding restored values
        self.nbytes = 0  # the size of the restored state (the event's `bytes`)
        self.preloaded = False  # loaded before the view came (a reserved spare's prefetch)

    def load_early(self) -> bool:
        """Load the whole state now, while the groups form; False: ``load_late`` loads it once they are built."""
        return False

    @abc.abstractmethod
    def load_late(self) -> None:
        """Once the groups are built: put back the RNG states that building them may have drawn from, or load
        what was not loaded before.

        Raises:
            RestoreFailed: a part of the state is not available (or does not fit this job).
            CollectiveAborted: a peer failed or a newer view interrupted a collective of the restore.
            WaitTimeout: a peer's answer did not come in time.
        """


class InitialPlan(Plan):
    """The job's initial state: nothing to load; the RNG states the script left before its first group build
    are put back, however often this member built its groups since."""

    source = Source.INITIAL

    def __init__(self, rng: dict[str, Any]) -> None:
        super().__init__()
        self._rng = rng

    def load_late(self) -> None:
        rng_mod.restore(self._rng)


class LocalPlan(Plan):
    """This member's own snapshot, whole: loaded while the groups form, keeping the live tensors that hold its
    values (a survivor that finished the resume step and whose lost step changed nothing)."""

    source = Source.LOCAL

    def __init__(self, tracked: TrackedState, held: Slot, restored: Restored, kept: dict[int, torch.Tensor]) -> None:
        super().__init__(held, kept)
        self._tracked = tracked
        self._restored = restored
        self._rng: dict[str, Any] = {}

    def load_early(self) -> bool:
        manifest, arena = self._restored
        self._rng, self.nbytes = self._tracked.load(manifest, arena, self.kept), manifest.nbytes
        return True

    def load_late(self) -> None:
        rng_mod.restore(self._rng)


class SlicesPlan(Plan):
    """This member's own snapshot, whose replicated region the peers' slices complete (its live tensors no
    longer hold it): loaded once the slices come."""

    source = Source.LOCAL

    def __init__(self, tracked: TrackedState, held: Slot, slices: Callable[[], Restored]) -> None:
        super().__init__(held)
        self._tracked = tracked
        self._slices = slices  # awaits the peers' slices into the snapshot's arena

    def load_late(self) -> None:
        manifest, arena = self._slices()
        self._tracked.load(manifest, arena, self.kept)
        self.nbytes = manifest.nbytes


class PreloadedPlan(Plan):
    """The buddy's copy (or, on a move's Takeover, the moving member's own snapshot), prefetched and loaded by a
    reserved spare before the view came; the view resumes from its step and names the same slices' sources."""

    source = Source.BUDDY

    def __init__(self, preloaded: Preloaded) -> None:
        super().__init__()
        self._rng: dict[str, Any] = preloaded.rng
        self.nbytes = preloaded.nbytes
        self.preloaded = True

    def load_early(self) -> bool:
        return True  # loaded already

    def load_late(self) -> None:
        rng_mod.restore(self._rng)


class MoverPlan(PreloadedPlan):
    """A move's: the moving member's own snapshot and the slices, prefetched on its Takeover and loaded."""

    source = Source.MOVER


class BuddyPlan(Plan):
    """The buddy's copy and the peers' slices, fetched while the groups form and loaded once they come."""

    source = Source.BUDDY

    def __init__(self, tracked: TrackedState, fetched: Callable[[], Restored]) -> None:
        super().__init__()
        self._tracked = tracked
        self._fetched = fetched  # awaits the fetch (``PeerFetch.from_buddy``)

    def load_late(self) -> None:
        manifest, arena = self._fetched()
        self._tracked.load(manifest, arena, self.kept)
        self.nbytes = manifest.nbytes


class DiskPlan(Plan):
    """The disk checkpoint of the seat: read before the groups form, its replicated region gathered from every
    seat's slice on the new group, then loaded."""

    source = Source.DISK

    def __init__(self, tracked: TrackedState, collectives: GroupCollectives, view: View, seat: int,
                 checkpoint_dir: str) -> None:
        """Raises:
            RestoreFailed: no checkpoint of the view's resume step holds this seat's state.
        """
        super().__init__()
        self._tracked = tracked
        self._collectives = collectives
        self._view = view
        self._seat = seat
        try:
            self._restored = checkpoint_load(checkpoint_dir, view.resume_step, seat)
        except LookupError as err:  # the checkpoint layer's "not there / not this seat's"
            raise RestoreFailed(str(err)) from err

    def load_late(self) -> None:
        manifest, arena = self._restored
        self._gather_replicated(manifest, arena)
        self._tracked.load(manifest, arena, self.kept)
        self.nbytes = manifest.nbytes

    def _gather_replicated(self, manifest: Manifest, arena: torch.Tensor) -> None:
        """Complete a restored arena: every seat's snapshot holds only its slice of the replicated region.

        One all-gather on the new group: each seat sends its slice and receives every other seat's, all of
        the same step.

        Raises:
            RestoreFailed: the snapshot's replicated region does not split into this job's slices.
            CollectiveAborted: a peer failed or a newer view interrupted the gather.
        """
        view, world = self._view, self._view.world_size
        if not manifest.replicated or world < 2:
            return
        if manifest.replicated % world:
            raise RestoreFailed(f"snapshot of step {view.resume_step}: its replicated region "
                                f"({manifest.replicated} bytes) does not split into {world} slices")
        first, last = replicated_slice(manifest, self._seat, world)
        chunk, start = last - first, manifest.replicated_at
        slices = [arena[start + i * chunk : start + (i + 1) * chunk] for i in range(world)]
        self._collectives.allgather(slices, arena[first:last].clone(),
                                    f"gathering the replicated state of step {view.resume_step}", view.epoch)
