"""Disk checkpoints hold what a seat's snapshot holds (its own state and its slice), and read back in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deadpool.snapshot import checkpoint
from deadpool.snapshot.statetree import held_ranges, materialize
from deadpool.snapshot.store import SnapshotStore


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, SnapshotStore, torch.Tensor, torch.Tensor]:
    weight, own = torch.randn(30_000), torch.arange(7.0)
    store = SnapshotStore(on_complete=lambda _: None)
    writer = checkpoint.DiskCheckpointer(str(tmp_path), every=1)
    slot = store.capture(4, "g", {"w": weight, "own": own}, set(), {weight.data_ptr()}, seat=1, world=3)
    store.wait_copy(10.0)
    assert writer.maybe_save(slot, seat=1)
    writer.wait(60.0)
    writer.close()
    yield tmp_path, store, weight, own
    store.close()


def test_a_checkpoint_reads_back_what_the_seat_held_at_the_manifests_offsets(saved: tuple) -> None:
    root, store, weight, own = saved
    slot = store.find(4)
    assert slot is not None and slot.manifest is not None
    manifest, arena = checkpoint.load(str(root), 4, seat=1)
    assert manifest.encode() == slot.manifest.encode()
    _, expected = store.restore_arena(slot)
    for start, end in held_ranges(manifest, 1, 3):
        assert torch.equal(arena[start:end], expected[start:end])
    assert torch.equal(materialize(manifest, arena)["own"], own)
    written = sum(p.stat().st_size for p in (root / "step-4" / "seat-1").rglob("*.distcp"))
    assert written < manifest.nbytes / 2, "only the seat's own state and its slice are written"


@pytest.mark.parametrize("layout", ['{"seat": 1}', "not json", '{"seat": 3, "world": 3}', '{"seat": 0, "world": 3}',
                                    '{"seat": 1, "world": 2}'])
def test_a_bad_held_layout_is_a_clear_error(saved: tuple, layout: str) -> None:
    root = saved[0]
    (root / "step-4" / "seat-1" / checkpoint.HELD).write_text(layout)
    with pytest.raises(LookupError):
        checkpoint.load(str(root), 4, seat=1)


def test_a_missing_checkpoint_is_a_clear_error(saved: tuple) -> None:
    with pytest.raises(LookupError, match="no complete disk checkpoint"):
        checkpoint.load(str(saved[0]), 5, seat=1)
    assert json.loads((saved[0] / "step-4" / "seat-1" / checkpoint.HELD).read_text()) == {"seat": 1, "world": 3}


def test_a_checkpoint_written_before_arenas_were_packed_still_loads(tmp_path: Path) -> None:
    """Older checkpoints hold one tensor per manifest entry at the manifest's offsets, and no held layout."""
    import torch.distributed.checkpoint as dcp

    from deadpool.snapshot.statetree import flatten, layout, view_tensor

    state = {"w": torch.randn(100), "own": torch.arange(5.0), "step": 3}
    skeleton, tensors = flatten(state)
    manifest = layout(tensors, skeleton, [False] * len(tensors), 1)
    target = tmp_path / "step-3" / "seat-0"
    target.mkdir(parents=True)
    (target / checkpoint.MANIFEST).write_bytes(manifest.encode())
    arena = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    for spec, tensor in zip(manifest.tensors, tensors, strict=True):
        view_tensor(arena, spec).copy_(tensor)
    dcp.save({"tensors": {str(i): view_tensor(arena, spec) for i, spec in enumerate(manifest.tensors)}},
             checkpoint_id=str(target), no_dist=True)
    (target / checkpoint.COMPLETE).write_text("3")
    loaded = materialize(*checkpoint.load(str(tmp_path), 3, seat=0))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["own"], state["own"]) and loaded["step"] == 3


def test_a_step_already_complete_on_disk_is_not_written_again(saved: tuple) -> None:
    # Restored from it (--resume, or a rollback to disk), the seat captures the same step again: rewriting it in
    # place would leave a complete-marked checkpoint half written if the job died meanwhile.
    root, store, weight, own = saved
    marker = checkpoint.step_dir(root, 4) / "seat-1" / checkpoint.COMPLETE
    before = marker.stat().st_mtime_ns
    slot = store.capture(4, "g", {"w": weight, "own": own}, set(), {weight.data_ptr()}, seat=1, world=3)
    store.wait_copy(10.0)
    writer = checkpoint.DiskCheckpointer(str(root), every=1)
    assert not writer.maybe_save(slot, seat=1)
    writer.close()
    assert marker.stat().st_mtime_ns == before
