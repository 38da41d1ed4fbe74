"""Local in-memory snapshots, copied off the critical path.

At the end of step k the compute thread captures the tracked state: it lays
out every tensor in a flat, preallocated byte arena (one of two slots; the
last two snapshots are kept), copies the few tensors that the next forward
pass may modify (buffers) at once, and hands the rest (parameters and
optimizer state, which change only inside ``optimizer.step()``) to a copy
thread.  Those copies overlap the next step's forward and backward; the
optimizer pre-step hook waits for them before parameters change.  That wait
is the only place snapshots can stall compute, and it is measured.

State that is the same on every seat (``rt.ddp`` parameters, a plain
optimizer's state for them) is sliced: each seat copies its own state and its
1/world slice of that region, and its arena packs exactly those bytes
(``statetree.held_ranges``), so a seat's snapshot memory, its buddy's copy
and a disk checkpoint are each about 1/world of the state.  A restore puts
the bytes back at the manifest's offsets and gathers the other slices.

On CPU the copy thread uses numpy (one thread, releases the GIL, ~12 GB/s,
and never competes for torch's intra-op pool).  On GPU the copy goes through
a side CUDA stream into page-locked host memory and an event marks it complete.

Where the arenas live (a shared-memory file a same-host buddy maps, or
private memory) is ``arena.py``'s business.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deadpool.errors import WaitTimeout
from deadpool.snapshot import shm
from deadpool.snapshot.arena import Arenas, Slot
from deadpool.snapshot.checksum import checksum, part_ranges
from deadpool.snapshot.statetree import Manifest, TensorSpec, expand, flatten, held_nbytes, held_ranges, layout

__all__ = ["Slot", "SnapshotStore", "on_accelerator"]

log = logging.getLogger("deadpool.snapshot.store")


def on_accelerator(tensors: list[torch.Tensor]) -> bool:
    """The GPU path is taken when any tracked tensor lives on a CUDA device."""
    return any(t.is_cuda for t in tensors)


def _copy_ranges(manifest: Manifest, seat: int, world: int) -> list[tuple[int, int, int, int, int]]:
    """What `seat` copies into its arena: (tensor index, arena begin, arena end, byte range within the
    tensor) for every part of a tensor in what the seat holds (``statetree.held_ranges``), which the
    arena packs back to back, in order."""
    ranges = []
    packed = 0  # where the held range starts in the arena
    for start, end in held_ranges(manifest, seat, world):
        for index, spec in enumerate(manifest.tensors):
            begin, stop = max(spec.offset, start), min(spec.offset + spec.nbytes, end)
            if begin < stop:
                ranges.append((index, packed + begin - start, packed + stop - start,
                               begin - spec.offset, stop - spec.offset))
        packed += end - start
    return ranges


@dataclass
class _CopyJob:
    slot: Slot
    pairs: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]
    cuda_event: Any = None
    checked: list[np.ndarray[Any, Any]] | None = None  # the replicated bytes to checksum after the copies


class SnapshotStore:
    """The local snapshot slots (two, or more to reach back past a corruption) and the thread that fills them."""

    def __init__(
        self,
        on_complete: Callable[[Slot], None],
        after_copy: Callable[[Slot], None] | None = None,
        shm_dir: str = "",
        member: str = "",
        depth: int = 2,
    ) -> None:
        self._slots = [Slot(index) for index in range(max(2, depth))]
        self._arenas = Arenas(shm_dir, member)
        self._on_complete = on_complete
        self._after_copy = after_copy  # runs on the copy thread before the slot may be reused (disk checkpoints)
        self._jobs: queue.Queue[_CopyJob | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._copy_loop, name="deadpool-snapshot-copy", daemon=True)
        self._thread.start()
        self._pending: Slot | None = None
        self._cuda_stream: Any = None
        self._sequence = 0
        self._layout_key: list[tuple[Any, ...]] = []
        self._layout_specs: tuple[TensorSpec, ...] | None = None
        self._layout_nbytes = 0
        self._layout_replicated = 0
        self._target_views: dict[int, tuple[torch.Tensor, tuple[TensorSpec, ...], tuple[int, int],
                                            list[tuple[int, np.ndarray[Any, Any], int, int]]]] = {}
        self._source_views: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self._ranges_key: tuple[tuple[TensorSpec, ...], int, int] | None = None
        self._ranges: list[tuple[int, int, int, int, int]] = []
        self.bytes_per_snapshot = 0  # the whole state
        self.bytes_copied_per_snapshot = 0  # what this seat copies and holds: own state, slice of the replicated

    # -- capture ------------------------------------------------------------------------------

    def capture(
        self, step: int, generation: str, state: Any, background: set[int],
        replicated: set[int] | frozenset[int] = frozenset(), seat: int = 0, world: int = 1,
        check: tuple[int, int] | None = None,
    ) -> Slot:
        """Start a snapshot of `state` as the state after `step`.

        Tensors whose storage pointer is in `background` are copied by the copy
        thread; all others are copied before this returns.  Tensors whose pointer
        is in `replicated` are the same on every one of `world` seats: only
        `seat`'s slice of them is copied (``statetree.replicated_slice``).
        `check` (part, parts): the copy thread also checksums that part of the
        replicated region (``checksum.py``) into ``slot.check``, on the CPU path.
        """
        self.wait_copy(timeout=60.0)
        skeleton, tensors = flatten(state)
        manifest = self._layout(skeleton, tensors, replicated, world)
        slot = self._free_slot()
        slot.complete = False
        slot.done.clear()
        if slot.head is not None:
            shm.invalidate_head(slot.head)  # before a byte of the arena changes: a buddy may be mapping it
        self._sequence += 1
        slot.step, slot.generation, slot.manifest, slot.sequence = step, generation, manifest, self._sequence
        slot.seat, slot.world, slot.nbytes = seat, world, held_nbytes(manifest, seat, world)
        slot.check = None
        on_gpu = on_accelerator(tensors)
        if slot.arena is None or slot.arena.numel() < slot.nbytes or (on_gpu and not slot.pinned):
            self._arenas.allocate(slot, max(slot.nbytes, 1), on_gpu)
        assert slot.arena is not None
        self.bytes_per_snapshot = manifest.nbytes
        if on_gpu:
            self._capture_cuda(slot, manifest, tensors, background, seat, world)
            return slot
        pairs = []
        sources = self._sources(tensors)
        targets = self._targets(slot, manifest, seat, world)
        self.bytes_copied_per_snapshot = sum(hi - lo for _, _, lo, hi in targets)
        for index, dst, lo, hi in targets:
            pointer, src = sources[index]
            if pointer in background:
                pairs.append((dst, src[lo:hi]))
            else:
                np.copyto(dst, src[lo:hi])
        checked = None
        if check is not None and manifest.replicated:
            # Only optimizer.step() changes the replicated tensors, and its pre-step hook waits for this job.
            checked = [sources[index][1][lo:hi] for index, lo, hi in part_ranges(manifest, *check)]
        self._pending = slot
        self._jobs.put(_CopyJob(slot, pairs, checked=checked))
        return slot

    # The layout and the numpy views of both sides are made once and reused while nothing changes: the
    # boundary then costs a few attribute reads per tensor instead of a layout and four tensor operations.

    def _layout(
        self, skeleton: bytes, tensors: list[torch.Tensor], replicated: set[int] | frozenset[int], world: int,
    ) -> Manifest:
        """Where each tensor goes in the arena; the previous placement when nothing about it changed."""
        flags = [bool(replicated) and t.data_ptr() in replicated for t in tensors]
        key: list[tuple[Any, ...]] = [(world,), *((t.dtype, t.shape, f) for t, f in zip(tensors, flags, strict=True))]
        if self._layout_key != key or self._layout_specs is None:
            placed = layout(tensors, skeleton, flags, world)
            self._layout_key, self._layout_specs = key, placed.tensors
            self._layout_nbytes, self._layout_replicated = placed.nbytes, placed.replicated
            return placed
        return Manifest(skeleton, self._layout_specs, self._layout_nbytes, self._layout_replicated)

    def _targets(
        self, slot: Slot, manifest: Manifest, seat: int, world: int,
    ) -> list[tuple[int, np.ndarray[Any, Any], int, int]]:
        """What to copy on the CPU path: `_copy_ranges` with numpy views of the arena.
        Reused for the same arena, placement and seat."""
        assert slot.arena is not None
        cached = self._target_views.get(slot.index)
        if cached is not None and cached[0] is slot.arena and cached[1] is manifest.tensors \
                and cached[2] == (seat, world):
            return cached[3]
        arena_np = slot.arena.numpy()
        targets = [(index, arena_np[begin:end], lo, hi) for index, begin, end, lo, hi in
                   self._cached_copy_ranges(manifest, seat, world)]
        self._target_views[slot.index] = (slot.arena, manifest.tensors, (seat, world), targets)
        return targets

    def _cached_copy_ranges(self, manifest: Manifest, seat: int, world: int) -> list[tuple[int, int, int, int, int]]:
        """`_copy_ranges` of the placement and seat, reused while they stay the same (a reused layout
        keeps its `manifest.tensors` object)."""
        key = (manifest.tensors, seat, world)
        if self._ranges_key is None or self._ranges_key[0] is not key[0] or self._ranges_key[1:] != key[1:]:
            self._ranges_key, self._ranges = key, _copy_ranges(manifest, seat, world)
        return self._ranges

    def _sources(self, tensors: list[torch.Tensor]) -> list[tuple[int, np.ndarray[Any, Any]]]:
        """(storage pointer, flat uint8 numpy view) of every tensor.

        A view made at the previous capture is reused for a contiguous tensor at the
        same address with the same size: that view keeps its storage alive, so no
        other tensor can live at that address, and the bytes are the same bytes.
        Only views seen at this capture are kept for the next one.
        """
        previous = self._source_views
        current: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        out = []
        for tensor in tensors:
            key = (tensor.data_ptr(), tensor.nbytes)
            contiguous = tensor.is_contiguous()
            view = previous.get(key) if contiguous else None
            if view is None:
                view = tensor.detach().reshape(-1).view(torch.uint8).numpy()
            if contiguous:
                current[key] = view
            out.append((key[0], view))
        self._source_views = current
        return out

    def _capture_cuda(
        self, slot: Slot, manifest: Manifest, tensors: list[torch.Tensor], background: set[int],
        seat: int, world: int,
    ) -> None:
        """GPU path: async device-to-pinned-host copies on a side stream, completed by an event.

        The side stream first waits for the compute stream (the state is final).  Tensors the next
        forward may change (not in `background`: buffers) are copied first, and the compute stream
        waits for those copies alone, on the GPU: the CPU never blocks here.  Parameters and optimizer
        state change only in ``optimizer.step()``, whose pre-step hook waits for the final event.
        As on the CPU path, only this seat's slice of the replicated region is copied.
        """
        assert slot.arena is not None
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream, compute = self._cuda_stream, torch.cuda.current_stream()
        ranges = self._cached_copy_ranges(manifest, seat, world)
        self.bytes_copied_per_snapshot = sum(end - begin for _, begin, end, _, _ in ranges)
        early = [r for r in ranges if tensors[r[0]].data_ptr() not in background]
        late = [r for r in ranges if tensors[r[0]].data_ptr() in background]
        stream.wait_stream(compute)
        arena = slot.arena

        def copy(batch: list[tuple[int, int, int, int, int]]) -> Any:
            for index, begin, end, lo, hi in batch:
                arena[begin:end].copy_(tensors[index].detach().reshape(-1).view(torch.uint8)[lo:hi], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            return event

        with torch.cuda.stream(stream):
            if early:
                compute.wait_event(copy(early))
            event = copy(late)
        self._pending = slot
        self._jobs.put(_CopyJob(slot, [], cuda_event=event))

    def _free_slot(self) -> Slot:
        """The oldest slot that does not hold the newest complete snapshot."""
        newest = self.newest()
        return min((s for s in self._slots if s is not newest), key=lambda s: s.sequence)

    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            for dst, src in job.pairs:
                np.copyto(dst, src)
            if job.checked is not None:
                job.slot.check = checksum(job.checked)
            if self._after_copy is not None:
                try:
                    self._after_copy(job.slot)
                except Exception:
                    log.exception("disk checkpoint of step %d failed", job.slot.step)
            job.slot.complete = True
            job.slot.done.set()
            try:
                self._on_complete(job.slot)
            except Exception:
                log.exception("snapshot completion callback failed")

    # -- waits and queries --------------------------------------------------------------------

    def wait_copy(self, timeout: float) -> float:
        """Wait for the in-flight copy; returns the seconds waited (the snapshot stall).

        Raises:
            WaitTimeout: the copy did not finish within `timeout` (a local memory copy; should never happen).
        """
        slot = self._pending
        if slot is None or slot.done.is_set():
            return 0.0
        start = time.perf_counter()
        if not slot.done.wait(timeout):
            raise WaitTimeout(f"local snapshot copy of step {slot.step} did not finish within {timeout:.0f}s")
        self._pending = None
        return time.perf_counter() - start

    def newest(self) -> Slot | None:
        complete = [slot for slot in self._slots if slot.complete]
        return max(complete, key=lambda s: s.sequence) if complete else None

    def newest_started(self) -> Slot | None:
        started = [slot for slot in self._slots if slot.step >= -1]
        return max(started, key=lambda s: s.sequence) if started else None

    def complete_steps(self) -> list[int]:
        return sorted(slot.step for slot in self._slots if slot.complete)

    def find(self, step: int) -> Slot | None:
        for slot in self._slots:
            if slot.complete and slot.step == step:
                return slot
        return None

    def forget_all(self, keep: Slot | None = None) -> None:
        """Forget every snapshot but `keep`: after a restore the live state is re-captured under the new group.

        `keep` (the snapshot a survivor restored from) stays complete until a later capture reuses its slot:
        the next capture goes into the other slot, so peers restoring in the same view can still ask for its
        slice of the replicated state.
        """
        self.wait_copy(timeout=60.0)
        for slot in self._slots:
            if slot is not keep:
                slot.complete = False
                slot.step = -2

    def memory_bytes(self) -> int:
        return sum(slot.arena.numel() for slot in self._slots if slot.arena is not None)

    @staticmethod
    def restore_arena(slot: Slot, kept: Collection[int] = ()) -> tuple[Manifest, torch.Tensor]:
        """A full arena with what the snapshot holds in place, to complete (replicated slices) and load from.

        When the snapshot holds all of it (no replicated region), that is the slot's own arena, not a copy:
        valid until the slot's next capture, and only read (``materialize`` clones out of it).  So is its
        start, the seat's own state, when every tensor but the `kept` ones (by manifest index: the caller
        takes them live, ``TrackedState.unchanged``) lies there: the replicated region is then never read."""
        assert slot.arena is not None and slot.manifest is not None
        manifest = slot.manifest
        if held_ranges(manifest, slot.seat, slot.world) == [(0, manifest.nbytes)]:
            return manifest, slot.arena[: max(manifest.nbytes, 1)]
        if kept and all(spec.offset + spec.nbytes <= manifest.replicated_at
                        for index, spec in enumerate(manifest.tensors) if index not in kept):
            return manifest, slot.arena[: max(manifest.replicated_at, 1)]  # held ranges are packed from 0
        return manifest, expand(manifest, [slot.payload()], slot.seat, slot.world)

    def close(self) -> None:
        """Stop the copy thread and remove the slot files (the memory stays mapped for whoever holds it)."""
        try:
            self._jobs.put(None, timeout=5.0)
        except queue.Full:
            log.warning("snapshot copy thread busy at shutdown; leaving it (daemon)")
        self._thread.join(timeout=5.0)
        for slot in self._slots:
            self._arenas.close(slot, unlock=not self._thread.is_alive())  # unlocked only with no copy in flight
