"""rt.ddp's fixed gradient buckets: layout, overlap with backward, averaging, abandoned buffers.

The runtime's step collectives are replaced by a recorder whose "all-reduce"
sums the bucket with copies of itself from `world - 1` identical peers, so the
average must equal the local gradient.  Real gloo groups, swaps and
bit-identical replay are covered end to end in test_hotswap.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from deadpool.chaos import ChaosPoint
from deadpool.worker.ddp import DataParallel, plan_buckets


class FakeCollectives:
    """A ``StepCollectives`` whose world is `world` identical seats."""

    def __init__(self, world: int = 4, fail: bool = False) -> None:
        self.world_size = world
        self.fail = fail
        self.log: list[str] = []
        self.flats: list[torch.Tensor] = []

    def fault_point(self, point: ChaosPoint) -> None:
        if point is ChaosPoint.BACKWARD:
            self.log.append("grad")

    def issue_allreduce(self, flat: torch.Tensor) -> Any:
        self.log.append(f"issue{len(self.flats)}")
        self.flats.append(flat)
        return object()

    def await_allreduces(self, works: Sequence[Any]) -> bool:
        self.log.append("await")
        if self.fail:
            return False
        for flat in self.flats:
            flat.mul_(self.world_size)  # world identical peers
        return True


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def reference_grads(x: torch.Tensor) -> list[torch.Tensor]:
    m = model()
    m(x).square().mean().backward()
    return [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]


def test_plan_is_reverse_order_capped_and_split_by_dtype() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    params.append(nn.Parameter(torch.zeros(5, dtype=torch.float64)))
    buckets = plan_buckets(params, bucket_bytes=4 * 50)
    assert [[p.numel() for p in b] for b in buckets] == [[5], [40], [30, 20], [10]]
    assert plan_buckets(params, bucket_bytes=4 * 50) == buckets  # deterministic
    assert plan_buckets(params, bucket_bytes=1) == [[p] for p in reversed(params)]  # oversized: one each


def test_buckets_are_issued_during_backward_in_order_and_average() -> None:
    x = torch.randn(16, 64)
    expected = reference_grads(x)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    assert len(ddp.buckets) >= 3
    ddp(x).square().mean().backward()
    issues = [i for i, e in enumerate(rt.log) if e.startswith("issue")]
    last_grad = max(i for i, e in enumerate(rt.log) if e == "grad")
    assert issues[0] < last_grad, "the first bucket must be issued while backward still runs"
    assert [rt.log[i] for i in issues] == [f"issue{k}" for k in range(len(ddp.buckets))]
    assert rt.log[-1] == "await"
    for param, want in zip(ddp.module.parameters(), expected, strict=True):
        assert param.grad is not None
        assert torch.equal(param.grad, want)
        bucket = next(b for b in ddp.buckets if any(p is param for p in b.params))
        assert bucket.aliases(param.grad), "after backward a gradient is a view into its bucket"


def test_accumulating_in_place_reuses_the_bucket_and_still_averages() -> None:
    x = torch.randn(16, 64)
    expected = reference_grads(x)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    for _ in range(2):
        for param in ddp.module.parameters():
            if param.grad is not None:
                param.grad.zero_()  # zero_grad(set_to_none=False)
        rt.flats.clear()
        ddp(x).square().mean().backward()
    for param, want in zip(ddp.module.parameters(), expected, strict=True):
        assert torch.equal(param.grad, want)  # type: ignore[arg-type]


def test_parameter_without_gradient_gets_the_average_of_zeros() -> None:
    rt = FakeCollectives()
    net = model()
    extra = nn.Linear(4, 4)
    ddp = DataParallel(nn.ModuleDict({"net": net, "unused": extra}), rt, bucket_mb=0.1)
    ddp.module["net"](torch.randn(2, 64)).sum().backward()
    assert extra.weight.grad is not None and torch.count_nonzero(extra.weight.grad) == 0


def test_abandoned_all_reduce_renews_buffers_and_leaves_no_alias() -> None:
    x = torch.randn(16, 64)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    ddp(x).square().mean().backward()  # grads now alias the buckets
    old = [b.flat for b in ddp.buckets]
    rt.fail, rt.flats = True, []
    ddp(x).square().mean().backward()
    for bucket, flat in zip(ddp.buckets, old, strict=True):
        assert bucket.flat.data_ptr() != flat.data_ptr()
        for param in bucket.params:
            assert param.grad is not None
            assert param.grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    rt.fail, rt.flats = False, []
    for param in ddp.module.parameters():
        param.grad = None
    ddp(x).square().mean().backward()  # works again on the fresh buffers
    for param, want in zip(ddp.module.parameters(), reference_grads(x), strict=True):
        assert torch.equal(param.grad, want)  # type: ignore[arg-type]


def test_bad_bucket_size_is_refused() -> None:
    with pytest.raises(ValueError, match="bucket_mb"):
        DataParallel(model(), FakeCollectives(), bucket_mb=0)


def test_a_backward_that_raised_does_not_break_the_next_one() -> None:
    x = torch.randn(16, 64)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)

    def boom(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    early = ddp.module[0].weight.sum() * 0  # made first, so autograd reaches it last
    handle = early.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        (ddp(x).square().mean() + early).backward()
    handle.remove()
    assert "grad" in rt.log, "a gradient hook ran before the backward raised"
    rt.flats.clear()
    rt.log.clear()
    for param in ddp.module.parameters():
        param.grad = None
    ddp(x).square().mean().backward()
    assert rt.log[-1] == "await", "the next backward must end with the all-reduces awaited"
    assert sum(e.startswith("issue") for e in rt.log) == len(ddp.buckets)
    for param, want in zip(ddp.module.parameters(), reference_grads(x), strict=True):
        assert torch.equal(param.grad, want)  # type: ignore[arg-type]
