"""Snapshot slots and the memory their arenas live in.

A ``Slot`` is one flat byte arena and the snapshot it holds.  ``Arenas``
allocates it: a file in a shared-memory directory when one is configured
(``shm.py``; a buddy on the same host then maps it instead of receiving it,
and on the GPU path it is page-locked with ``cudaHostRegister``), else private
memory (pinned on the GPU path).  When the file cannot be made or locked, it
falls back to private memory once, says so, and stays there.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field

import torch

from deadpool.snapshot import shm
from deadpool.snapshot.statetree import Manifest

log = logging.getLogger("deadpool.snapshot.arena")


@dataclass
class Slot:
    """One arena and the snapshot it holds."""

    index: int
    arena: torch.Tensor | None = None  # uint8, pinned when the state lives on a GPU
    manifest: Manifest | None = None
    step: int = -2  # -2: empty; -1: the initial state
    seat: int = 0  # the seat and world size it was captured in: they say which slice it holds
    world: int = 1
    nbytes: int = 0  # bytes of the arena in use (what the snapshot holds)
    generation: str = ""  # process group generation (store prefix) the snapshot was taken in
    complete: bool = False
    pinned: bool = False  # page-locked host memory (the GPU path's copy target)
    registered: bool = False  # page-locked by `page_lock` (a shared-memory slot): unlocked when released
    sequence: int = 0  # capture order: the newest of two snapshots of the same step is the higher one
    done: threading.Event = field(default_factory=threading.Event)
    shm_path: str = ""  # the shared-memory file the arena lives in ("" for anonymous or pinned memory)
    mapping: mmap.mmap | None = None  # the file's mapping, referenced for as long as the arena is
    head: memoryview | None = None  # the file's head block (``shm.write_head``), before the arena
    allocation: int = 0  # which arena this is: a reallocated slot file is a new file under the same name
    check: int | None = None  # the checksum of this capture's part of the replicated region (``checksum.py``)

    def payload(self) -> memoryview:
        """What the snapshot holds, as the arena packs it (zero-copy): the whole state, or, with a
        replicated region, the seat's own state followed by its slice of the region
        (``statetree.held_ranges``).  What a buddy is streamed, or maps."""
        assert self.arena is not None
        return self.arena.numpy().data.cast("B")[: self.nbytes]


def allocate_arena(nbytes: int, pinned: bool) -> torch.Tensor:
    """A flat byte arena; pinned (page-locked) for device-to-host copies that run asynchronously."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def page_lock(arena: torch.Tensor) -> bool:
    """Page-lock memory we already own (a shared-memory slot) for the GPU's asynchronous copies.

    ``cudaHostRegister`` keeps the mapping, so a buddy on the same host can still map the slot's
    file; DCP's shared, pinned staging buffers are made the same way.  False if CUDA refuses; then
    the refusal is also taken off CUDA's per-thread last error, which the next kernel launch would
    otherwise report as its own failure.
    """
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    if int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 1)) == 0:  # 1: cudaHostRegisterPortable
        return True
    _clear_cuda_last_error()
    return False


def _clear_cuda_last_error() -> None:
    """``cudaGetLastError()`` of the CUDA runtime this process loaded (torch binds no call for it)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            if os.path.isabs(path):
                ctypes.CDLL(path).cudaGetLastError()
                return
    except (OSError, AttributeError) as err:
        log.warning("could not clear CUDA's last error after a refused page-lock (%s)", err)


def page_unlock(arena: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())  # type: ignore[no-untyped-call]


class Arenas:
    """Allocates and releases slots' arenas for one worker."""

    def __init__(self, shm_dir: str = "", member: str = "") -> None:
        self.shm_dir = shm_dir  # CPU arenas become files here, for a buddy on the same host to map ("" : off)
        self._member = member

    def allocate(self, slot: Slot, nbytes: int, pinned: bool) -> None:
        """A (new) arena for `slot`: a shared-memory file when configured (page-locked on the GPU path), else
        private memory (pinned on the GPU path)."""
        self.release(slot)
        slot.pinned = pinned
        slot.allocation += 1
        if self.shm_dir and pinned and not shm.in_memory_filesystem(self.shm_dir):
            log.warning("%s is not a memory filesystem, where CUDA can page-lock snapshot slots: using private "
                        "pinned memory; a buddy on this host gets its copies over TCP", self.shm_dir)
            self.shm_dir = ""
        if self.shm_dir:
            path = shm.slot_path(self.shm_dir, self._member, os.getpid(), slot.index)
            try:
                slot.mapping = shm.create(path, shm.HEAD_BYTES + nbytes)
            except OSError as err:
                log.warning("snapshot slots cannot live in %s (%s): using private memory; a buddy on this host "
                            "gets its copies over TCP", self.shm_dir, err)
                self.shm_dir = ""  # said once; the other slot does not try again
            else:
                slot.arena = torch.frombuffer(slot.mapping, dtype=torch.uint8, offset=shm.HEAD_BYTES)
                slot.head, slot.shm_path = memoryview(slot.mapping)[: shm.HEAD_BYTES], path
                if not pinned:
                    return
                if page_lock(slot.arena):
                    slot.registered = True
                    return
                log.warning("CUDA cannot page-lock the shared-memory snapshot slots: using private pinned memory; "
                            "a buddy on this host gets its copies over TCP")
                self.release(slot)
                self.shm_dir = ""
        slot.arena = allocate_arena(nbytes, pinned=pinned)

    @staticmethod
    def release(slot: Slot) -> None:
        """Forget a slot's arena; its file goes (a buddy's mapping, and views still being sent, stay valid)."""
        if slot.registered and slot.arena is not None:
            page_unlock(slot.arena)
        if slot.shm_path:
            shm.unlink(slot.shm_path)
        if slot.head is not None:
            slot.head.release()
        slot.arena, slot.mapping, slot.head, slot.shm_path, slot.registered = None, None, None, "", False

    @staticmethod
    def close(slot: Slot, unlock: bool) -> None:
        """At shutdown: remove the slot's file (its memory stays mapped for whoever holds it), and unlock its
        pages if `unlock` (no copy is in flight into them)."""
        if unlock and slot.registered and slot.arena is not None:
            page_unlock(slot.arena)
            slot.registered = False
        if slot.shm_path:
            shm.unlink(slot.shm_path)
