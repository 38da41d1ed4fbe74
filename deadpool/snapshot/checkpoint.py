"""Disk checkpoints: the fallback when a seat and the seat holding its copy die together.

Optional and off by default (``--checkpoint-dir DIR --checkpoint-every N``).
Every N steps the newest local snapshot, already laid out in its arena, is
copied once (a short staging copy) and written with ``torch.distributed.checkpoint.save``
in a background thread (one checkpoint per seat: ``DIR/step-K/seat-S``).  A
``COMPLETE`` marker is written when the save finished; only marked checkpoints
count, and the three newest complete steps are kept.

What is written is what the snapshot holds, as its arena packs it: the seat's
own state and its slice of the replicated region, one flat byte tensor.  The
non-tensor state (the snapshot manifest: structure, RNG states, scheduler and
optimizer settings) is written next to it as msgpack, never pickle, and the
seat and world size that say which slice it is as JSON.  Restore lets DCP fill
a byte tensor in place and puts it back at the manifest's offsets; the runtime
gathers the replicated slices and unflattens: the result is bit-identical to
the snapshot.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import Manifest, expand, held_nbytes, view_tensor

log = logging.getLogger("deadpool.snapshot.checkpoint")

MANIFEST = "deadpool-manifest.msgpack"
HELD = "deadpool-held.json"  # the seat and world size the snapshot was captured in
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(-?\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def complete_steps(root: Path, world_size: int) -> list[int]:
    """Steps for which every seat's checkpoint is complete (readable by any member on a shared filesystem)."""
    steps: list[int] = []
    if not root.is_dir():
        return steps
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and all((entry / f"seat-{seat}" / COMPLETE).exists() for seat in range(world_size)):
            steps.append(int(match.group(1)))
    return sorted(steps)


class DiskCheckpointer:
    """Writes this seat's snapshots to disk every N steps, in the background."""

    def __init__(self, root: str, every: int) -> None:
        self.root = Path(root)
        self.every = every
        self._pending: Any = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="deadpool-ckpt")
        if self.enabled:
            # torch.distributed.checkpoint pulls in DTensor (half a CPU-second): imported only by jobs that
            # write checkpoints, and here, not on the copy thread in the middle of a step.
            import torch.distributed.checkpoint  # noqa: F401

    @property
    def enabled(self) -> bool:
        return bool(self.every) and bool(str(self.root))

    def maybe_save(self, slot: Slot, seat: int) -> bool:
        """Start saving `slot` if its step is due; skipped (and logged) while the previous save still runs."""
        if not self.enabled or slot.manifest is None or slot.arena is None or (slot.step + 1) % self.every:
            return False
        if self._pending is not None and not self._pending.done():
            log.warning("disk checkpoint of step %d skipped: the previous one is still being written", slot.step)
            return False
        target = step_dir(self.root, slot.step) / f"seat-{seat}"
        if (target / COMPLETE).exists():
            return False  # restored from it (--resume, or a rollback to disk): the same state, already written
        target.mkdir(parents=True, exist_ok=True)
        (target / MANIFEST).write_bytes(slot.manifest.encode())
        (target / HELD).write_text(json.dumps({"seat": slot.seat, "world": slot.world}))
        # The slot is written again two snapshots later: the write takes its own copy (what async_save's
        # stager would do; async_save itself refuses to run once the script has DeadPool's default group,
        # which has no CPU backend of torch's own).
        held = slot.arena[: slot.nbytes].clone()
        self._pending = self._executor.submit(self._write, held, target, slot.step)
        return True

    def _write(self, held: torch.Tensor, target: Path, step: int) -> None:
        """Background: write the copy, mark it complete, keep only the three newest complete steps."""
        from torch.distributed.checkpoint.state_dict_saver import save

        save({"held": held}, checkpoint_id=str(target), no_dist=True)
        (target / COMPLETE).write_text(str(step))
        steps = sorted(int(m.group(1)) for e in self.root.iterdir() if (m := _STEP_DIR.match(e.name)))
        for old in steps[:-3]:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)

    def wait(self, timeout: float) -> None:
        if self._pending is not None:
            self._pending.result(timeout=timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)


def load(root: str, step: int, seat: int) -> tuple[Manifest, torch.Tensor]:
    """The snapshot a seat had after `step`, read back from disk: its manifest and arena.

    Like the in-memory snapshot it was written from, the arena holds only this seat's
    slice of the replicated region; the restore gathers the other slices.

    Raises:
        LookupError: no complete checkpoint of that step for that seat.
    """
    target = step_dir(Path(root), step) / f"seat-{seat}"
    if not (target / COMPLETE).exists():
        raise LookupError(f"no complete disk checkpoint of step {step} for seat {seat} under {root}")
    manifest = Manifest.decode((target / MANIFEST).read_bytes(), max_nbytes=1 << 40)
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if not (target / HELD).exists():  # written before arenas were packed: one tensor per manifest entry
        arena = torch.empty(max(manifest.nbytes, 1), dtype=torch.uint8)
        tensors = {str(i): view_tensor(arena, spec) for i, spec in enumerate(manifest.tensors)}
        dcp_load({"tensors": tensors}, checkpoint_id=str(target), no_dist=True)
        return manifest, arena
    written_seat, world = _held_layout(target / HELD)
    if written_seat != seat or (manifest.replicated and manifest.replicated % world):
        raise LookupError(f"disk checkpoint {target}: written by seat {written_seat} of {world}, "
                          f"which does not fit seat {seat} and its manifest")
    expected = held_nbytes(manifest, seat, world)
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    written = getattr(FileSystemReader(str(target)).read_metadata().state_dict_metadata.get("held"), "size", None)
    if written != torch.Size([expected]):
        raise LookupError(f"disk checkpoint {target}: holds {written} bytes where seat {seat} of {world} "
                          f"holds {expected}")
    held = torch.empty(expected, dtype=torch.uint8)
    dcp_load({"held": held}, checkpoint_id=str(target), no_dist=True)
    return manifest, expand(manifest, [held.numpy().data.cast("B")], seat, world)


def _held_layout(path: Path) -> tuple[int, int]:
    """(seat, world size) from a checkpoint's held-layout file.

    Raises:
        LookupError: the file is not a JSON object with a seat in 0..world-1 and a world size of at least 1.
    """
    try:
        layout = json.loads(path.read_text())
        seat, world = layout["seat"], layout["world"]
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise LookupError(f"unreadable {path}: {err}") from err
    if not (isinstance(seat, int) and isinstance(world, int) and 0 <= seat < world):
        raise LookupError(f"{path}: seat {seat!r} and world size {world!r} are not a seat of a job")
    return seat, world
