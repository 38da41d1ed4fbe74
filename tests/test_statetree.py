"""Snapshots: structure and tensors round-trip exactly; the digest sees every bit."""

from __future__ import annotations

import random

import pytest
import torch

from deadpool.errors import MisuseError
from deadpool.snapshot import SnapshotStore
from deadpool.statetree import Manifest, flatten, layout, materialize, unflatten


def training_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_tuples_int_keys_and_tensors() -> None:
    state = training_state()
    skeleton, tensors = flatten(state)
    assert_same(unflatten(skeleton, tensors), state)


def test_arena_round_trip_and_manifest_validation() -> None:
    state = training_state()
    skeleton, tensors = flatten(state)
    manifest = layout(tensors, skeleton)
    arena = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    for spec, tensor in zip(manifest.tensors, tensors):
        arena[spec.offset : spec.offset + spec.nbytes] = tensor.reshape(-1).view(torch.uint8)
    decoded = Manifest.decode(manifest.encode(), max_nbytes=1 << 30)
    assert decoded == manifest
    assert_same(materialize(decoded, arena), state)
    with pytest.raises(ValueError):
        Manifest.decode(manifest.encode(), max_nbytes=10)
    with pytest.raises(ValueError):
        Manifest.decode(b"\x93garbage", max_nbytes=1 << 30)


def test_unsnapshottable_values_get_a_clear_error() -> None:
    with pytest.raises(MisuseError, match="cannot snapshot a value of type object"):
        flatten({"x": object()})


def test_store_copies_in_background_and_keeps_two() -> None:
    ready: list[int] = []
    store = SnapshotStore(on_complete=lambda slot: ready.append(slot.step))
    try:
        weights = torch.arange(1000, dtype=torch.float32)
        for step in range(3):
            weights.add_(1)
            store.capture(step, "g", {"w": weights}, background={weights.data_ptr()})
            store.wait_copy(5.0)
        assert store.complete_steps() == [1, 2]
        slot = store.find(2)
        assert slot is not None
        restored = store.restore_state(slot)
        assert torch.equal(restored["w"], weights)
        assert restored["w"].data_ptr() != weights.data_ptr(), "restores are clones, never views of the arena"
        assert ready == [0, 1, 2]
    finally:
        store.close()
