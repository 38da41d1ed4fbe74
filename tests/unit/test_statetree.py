"""Snapshots: structure and tensors round-trip exactly; the digest sees every bit."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from deadpool.errors import MisuseError
from deadpool.snapshot.statetree import (
    Manifest,
    SpecCache,
    TensorSpec,
    flatten,
    layout,
    materialize,
    replicated_slice,
    unflatten,
)
from deadpool.snapshot.store import SnapshotStore


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


def _reference_encoding(manifest: Manifest) -> bytes:
    """What Manifest.encode produced before the spec section was cached: one packb of the whole."""
    specs = [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in manifest.tensors]
    packed: bytes = msgpack.packb([manifest.skeleton, specs, manifest.nbytes, manifest.replicated], use_bin_type=True)
    return packed


def _raw_manifest(skeleton: bytes, specs: list[list[object]], nbytes: int) -> bytes:
    packed: bytes = msgpack.packb([skeleton, specs, nbytes], use_bin_type=True)
    return packed


def test_encoding_reuses_an_unchanged_layout_and_is_byte_identical() -> None:
    skeleton, tensors = flatten(training_state())
    manifest = layout(tensors, skeleton)
    again = Manifest(b"another skeleton", manifest.tensors, manifest.nbytes, 64)  # same specs tuple: cached part
    for m in (manifest, again, manifest):
        assert m.encode() == _reference_encoding(m)
    other = layout(tensors[:1], skeleton)  # a new layout is packed afresh
    assert other.encode() == _reference_encoding(other)
    assert Manifest.decode(again.encode(), 1 << 30) == again


def test_spec_cache_reuses_validated_specs_and_revalidates_anything_changed() -> None:
    good = [["float32", [2, 3], 0, 24], ["int64", [4], 64, 32]]
    cache = SpecCache()
    first = Manifest.decode(_raw_manifest(b"s1", good, 96), 1 << 30, cache)
    assert first.tensors == (TensorSpec("float32", (2, 3), 0, 24), TensorSpec("int64", (4,), 64, 32))
    # Same specs, new skeleton: reused (the very same validated tuple), the skeleton is the new one.
    second = Manifest.decode(_raw_manifest(b"s2", good, 96), 1 << 30, cache)
    assert second.skeleton == b"s2" and second.tensors is first.tensors
    # Changed specs that are bad are rejected, and leave the cache as it was.
    bad_cases = {
        "tensor lies outside the arena": [["float32", [2, 3], 0, 24], ["int64", [4], 80, 32]],
        "unknown dtype": [["float32", [2, 3], 0, 24], ["pickle", [4], 64, 32]],
        "tensor size does not match its shape": [["float32", [2, 4], 0, 24], ["int64", [4], 64, 32]],
        "bad tensor shape": [["float32", [2.0, 3], 0, 24], ["int64", [4], 64, 32]],  # equal as a list, not as bytes
        "malformed tensor spec": [["float32", [2, 3], 0]],
    }
    for message, specs in bad_cases.items():
        with pytest.raises(ValueError, match=message):
            Manifest.decode(_raw_manifest(b"s3", specs, 96), 1 << 30, cache)
        assert cache.tensors is first.tensors
    # The same specs against a smaller arena are validated again (and fail), as are other limits.
    with pytest.raises(ValueError, match="outside the arena"):
        Manifest.decode(_raw_manifest(b"s4", good, 90), 1 << 30, cache)
    with pytest.raises(ValueError, match="limit is 50"):
        Manifest.decode(_raw_manifest(b"s5", good, 96), 50, cache)
    # Malformed frames are rejected before the cache is looked at.
    valid = _raw_manifest(b"s6", good, 96)
    for broken in (valid + b"\x00", valid[:-1], b"\x92" + valid[1:], b"\x93garbage", b"", b"\xc1"):
        with pytest.raises(ValueError, match="malformed manifest"):
            Manifest.decode(broken, 1 << 30, cache)
    with pytest.raises(ValueError, match="wrong field types"):
        Manifest.decode(msgpack.packb(["s", good, 96]), 1 << 30, cache)  # skeleton as str, not bytes
    with pytest.raises(ValueError, match="wrong field types"):
        Manifest.decode(msgpack.packb([b"s", {"a": 1}, 96], use_bin_type=True), 1 << 30, cache)
    # Valid changed specs are validated and then become the cached ones.
    grown = [*good, ["float64", [1], 128, 8]]
    third = Manifest.decode(_raw_manifest(b"s7", grown, 192), 1 << 30, cache)
    assert len(third.tensors) == 3 and cache.tensors is third.tensors and cache.nbytes == 192


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
        restored = materialize(*store.restore_arena(slot))
        assert torch.equal(restored["w"], weights)
        assert restored["w"].data_ptr() != weights.data_ptr(), "restores are clones, never views of the arena"
        assert ready == [0, 1, 2]
    finally:
        store.close()


def test_replicated_tensors_go_last_in_equal_slices_one_per_seat() -> None:
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.int64), torch.zeros(100)]
    manifest = layout(tensors, b"s", replicated=[True, False, True], world=3)
    private, first, last = manifest.tensors[1], manifest.tensors[0], manifest.tensors[2]
    assert private.offset == 0 and manifest.replicated_at == 64  # the private tensor first, aligned
    assert manifest.replicated_at <= first.offset < last.offset
    assert manifest.replicated % (3 * 64) == 0 and manifest.replicated >= 64 + 400  # padded to 3 aligned slices
    slices = [replicated_slice(manifest, seat, 3) for seat in range(3)]
    assert slices[0][0] == manifest.replicated_at and slices[-1][1] == manifest.nbytes
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))  # adjacent, no gap
    decoded = Manifest.decode(manifest.encode(), 1 << 20)
    assert decoded == manifest
    assert layout(tensors, b"s").replicated == 0  # nothing flagged: nothing sliced


def test_manifest_with_a_bad_replicated_region_is_refused_and_old_three_field_ones_load() -> None:
    good = [["float32", [2, 3], 0, 24]]
    bad: bytes = msgpack.packb([b"s", good, 64, 65], use_bin_type=True)
    with pytest.raises(ValueError, match="replicated region"):
        Manifest.decode(bad, 1 << 20)
    old = Manifest.decode(_raw_manifest(b"s", good, 64), 1 << 20)  # disk checkpoints of earlier versions
    assert old.replicated == 0 and old.replicated_at == 64
