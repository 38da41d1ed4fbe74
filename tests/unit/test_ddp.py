"""rt.ddp's fixed gradient buckets: layout, overlap with backward, averaging, abandoned buffers,
no_sync() accumulation and the broadcast of module buffers.

The runtime's step collectives are replaced by a recorder whose "all-reduce"
sums the bucket with copies of itself from `world - 1` identical peers, so the
average must equal the local gradient, and whose "broadcast" writes what seat 0
would send.  Real gloo groups, swaps and bit-identical replay are covered end to
end in test_hotswap.py and test_user_collectives.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch
from torch import nn

from deadpool.chaos import ChaosPoint
from deadpool.worker.ddp import DataParallel, plan_buckets
from deadpool.worker.lost_step import AbandonableBackward, StepAbandoned


class FakeCollectives:
    """A ``StepCollectives`` whose world is `world` identical seats."""

    def __init__(self, world: int = 4, fail: bool = False, root: torch.Tensor | None = None) -> None:
        self.world_size = world
        self.fail = fail
        self.log: list[str] = []
        self.flats: list[torch.Tensor] = []
        self.root = root  # what seat 0's buffer broadcast carries (None: this seat is seat 0)
        self.broadcasts: list[torch.Tensor] = []  # what this seat packed, per broadcast
        self.lost = False  # the step is lost (a Prepare came or a collective failed)

    def step_lost(self) -> bool:
        return self.lost

    def fault_point(self, point: ChaosPoint) -> None:
        if point is ChaosPoint.BACKWARD:
            self.log.append("grad")

    def packed_gradient(self, flat: torch.Tensor) -> None:
        pass  # no chaos, no audit here

    def local_only(self) -> bool:
        return False

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

    def broadcast_buffers(self, flat: torch.Tensor) -> bool:
        self.log.append("broadcast")
        self.broadcasts.append(flat.clone())
        if self.fail:
            return False
        if self.root is not None:
            flat.copy_(self.root)
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


def test_a_lost_step_abandons_its_backward_at_the_first_gradient_and_the_next_one_is_whole() -> None:
    x = torch.randn(16, 64)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    backward = AbandonableBackward()
    backward.install()
    try:
        rt.lost = True
        ddp(x).square().mean().backward()  # returns: the hook's StepAbandoned never reaches the caller
        assert rt.log == ["grad"], "one gradient hook ran, then nothing was issued or awaited"
        rt.lost = False
        rt.flats.clear()
        rt.log.clear()
        for param in ddp.module.parameters():
            param.grad = None
        ddp(x).square().mean().backward()
    finally:
        backward.uninstall()
    assert torch.autograd.backward is not None and rt.log[-1] == "await"
    for param, want in zip(ddp.module.parameters(), reference_grads(x), strict=True):
        assert torch.equal(param.grad, want)  # type: ignore[arg-type]


def test_without_the_wrapper_an_abandoned_backward_raises() -> None:
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    rt.lost = True
    with pytest.raises(StepAbandoned):
        ddp(torch.randn(4, 64)).sum().backward()


class Tap(nn.Module):
    """Counts its calls; at call `lose_at` it loses the step, as a Prepare arriving mid-forward does."""

    def __init__(self, rt: FakeCollectives, lose_at: int = -1) -> None:
        super().__init__()
        self.rt, self.calls, self.lose_at = rt, 0, lose_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.lose_at:
            self.rt.lost = True
        return x


class Pair(nn.Module):
    """A model whose output is a tuple with a plain value in it, as the demos' (logits, loss) is."""

    def __init__(self, rt: FakeCollectives) -> None:
        super().__init__()
        self.first, self.tap, self.last = nn.Linear(64, 32), Tap(rt, lose_at=2), nn.Linear(32, 8)
        self.after = Tap(rt)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int, torch.Tensor]:
        out = self.after(self.last(self.tap(self.first(x))))
        return out, None, 7, out.argmax(-1)


def test_a_lost_steps_forward_stops_at_the_next_submodule_with_stand_ins_of_the_last_outputs_shapes() -> None:
    rt = FakeCollectives()
    module = Pair(rt)
    ddp = DataParallel(module, rt, bucket_mb=0.1)
    x = torch.randn(16, 64)
    real = ddp(x)  # a whole forward: its output's shapes are remembered for inputs shaped like x
    assert (module.tap.calls, module.after.calls) == (1, 1)
    backward = AbandonableBackward()
    backward.install()
    try:
        rt.log.clear()
        lost = ddp(x)  # the tap loses the step: the forward stops before the next submodule
        assert (module.tap.calls, module.after.calls) == (2, 1)
        assert lost[1:3] == (None, 7)
        for want, got in ((real[0], lost[0]), (real[3], lost[3])):
            assert (got.shape, got.dtype, got.requires_grad) == (want.shape, want.dtype, want.requires_grad)
            assert not got.any()
        lost[0].square().mean().backward()  # reaches one gradient hook, which abandons the backward
        assert rt.log == ["grad"]
        assert ddp(x)[0].shape == real[0].shape and module.tap.calls == 2, "lost before it began: nothing ran"
        rt.lost = False
        assert torch.equal(ddp(x)[0], real[0]) and module.tap.calls == 3, "the next step's forward is whole"
    finally:
        backward.uninstall()


def test_a_lost_forward_runs_whole_when_nothing_can_stand_in_for_its_output() -> None:
    rt = FakeCollectives()
    module = Pair(rt)
    ddp = DataParallel(module, rt, bucket_mb=0.1)
    ddp(torch.randn(16, 64))
    rt.lost = True
    out = ddp(torch.randn(5, 64))  # inputs of a shape never seen: no output to copy the shapes of
    assert out[0].shape == (5, 8) and module.after.calls == 2 and out[0].any()

    class Box:
        def __init__(self, value: torch.Tensor) -> None:
            self.value = value

    rt.lost = False
    linear = nn.Sequential(nn.Linear(64, 8))
    linear.register_forward_hook(lambda _m, _a, out: Box(out))  # an output pytree cannot look into
    seq = DataParallel(linear, rt, bucket_mb=0.1)
    seq(torch.randn(4, 64))
    rt.lost = True
    assert seq(torch.randn(4, 64)).value.any(), "run whole: a stand-in for an opaque output cannot be made"


# -- no_sync(): gradient accumulation ----------------------------------------------------------


def test_no_sync_accumulates_locally_and_the_next_backward_all_reduces_the_sum() -> None:
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)
    reference = model()
    reference(x1).square().mean().backward()
    reference(x2).square().mean().backward()  # autograd accumulates: the sum of both micro-batches
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    with ddp.no_sync():
        ddp(x1).square().mean().backward()
    assert not any(e.startswith("issue") or e == "await" for e in rt.log), "no all-reduce inside no_sync()"
    ddp(x2).square().mean().backward()
    assert sum(e.startswith("issue") for e in rt.log) == len(ddp.buckets), "one all-reduce per bucket, once"
    for param, want in zip(ddp.module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.grad, want.grad)  # type: ignore[arg-type]


def test_no_sync_accumulates_into_the_bucket_views_left_by_the_previous_step() -> None:
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    ddp(x1).square().mean().backward()  # gradients are bucket views now
    for param in ddp.module.parameters():
        param.grad.zero_()  # type: ignore[union-attr]  # zero_grad(set_to_none=False)
    rt.flats.clear()
    reference = model()
    with ddp.no_sync():
        ddp(x1).square().mean().backward()
        reference(x1).square().mean().backward()
    ddp(x2).square().mean().backward()
    reference(x2).square().mean().backward()
    for param, want in zip(ddp.module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.grad, want.grad)  # type: ignore[arg-type]


def test_the_forward_decides_whether_its_backward_syncs_as_in_ddp() -> None:
    x = torch.randn(16, 64)
    rt = FakeCollectives()
    ddp = DataParallel(model(), rt, bucket_mb=0.1)
    with ddp.no_sync():
        loss = ddp(x).square().mean()
    loss.backward()  # forward inside: no sync, though the backward runs outside
    assert "await" not in rt.log
    loss = ddp(x).square().mean()
    with ddp.no_sync():
        loss.backward()  # forward outside: syncs
    assert rt.log[-1] == "await"


# -- buffers: broadcast from seat 0 ------------------------------------------------------------


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))


def bn_buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in module.buffers()]


def seat_zero_payload(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What seat 0 broadcasts after its forward on `x`, and its buffers then."""
    rt = FakeCollectives(world=2)
    ddp = DataParallel(bn_model(), rt)
    ddp(x)
    [payload] = rt.broadcasts
    return payload, bn_buffers(ddp.module)


def test_buffers_are_seat_zeros_after_a_training_forward_in_one_flat_broadcast() -> None:
    payload, seat0 = seat_zero_payload(torch.randn(32, 8))
    rt = FakeCollectives(world=2, root=payload)
    ddp = DataParallel(bn_model(), rt)
    ddp(torch.randn(32, 8) * 3 + 1)  # another seat's batch: its own statistics before the broadcast
    assert rt.log.count("broadcast") == 1, "one packed broadcast for every buffer"
    buffers = list(ddp.module.buffers())
    assert {b.dtype for b in buffers} == {torch.float32, torch.int64}  # running stats and num_batches_tracked
    assert all(torch.equal(b, want) for b, want in zip(buffers, seat0, strict=True))
    assert not torch.equal(rt.broadcasts[0], payload), "this seat's own statistics differed before"


def test_buffers_are_not_broadcast_in_eval_without_grad_inside_no_sync_or_when_turned_off() -> None:
    x = torch.randn(32, 8)
    rt = FakeCollectives(world=2)
    ddp = DataParallel(bn_model(), rt)
    ddp.eval()
    ddp(x)
    ddp.train()
    with torch.no_grad():
        ddp(x)
    with ddp.no_sync():
        ddp(x)
    assert "broadcast" not in rt.log
    ddp(x)
    assert rt.log.count("broadcast") == 1
    off = FakeCollectives(world=2)
    DataParallel(bn_model(), off, broadcast_buffers=False)(x)
    assert "broadcast" not in off.log
    alone = FakeCollectives(world=1)
    DataParallel(bn_model(), alone)(x)
    assert "broadcast" not in alone.log, "a world of one has nobody to agree with"


def test_a_failed_buffer_broadcast_leaves_the_local_buffers() -> None:
    payload, _ = seat_zero_payload(torch.randn(32, 8))
    rt = FakeCollectives(world=2, fail=True, root=payload)
    ddp = DataParallel(bn_model(), rt)
    ddp(torch.randn(32, 8))
    local = bn_buffers(ddp.module)
    assert all(torch.equal(b, want) for b, want in zip(ddp.module.buffers(), local, strict=True))
    assert rt.log == ["broadcast"]


def test_backward_still_works_after_the_buffers_were_overwritten() -> None:
    """The forward saved buffers for backward (a frozen BatchNorm does); the copy keeps their versions."""
    payload, _ = seat_zero_payload(torch.randn(32, 8))
    rt = FakeCollectives(world=2, root=payload)
    net = bn_model()
    net[4].eval()  # frozen: its forward uses (and saves) the running statistics
    ddp = DataParallel(net, rt)
    ddp(torch.randn(32, 8)).square().mean().backward()
    assert rt.log[0] == "broadcast" and rt.log[-1] == "await"


def test_a_compiled_model_runs_its_lost_forward_whole() -> None:
    """torch.compile would trace the pre-hooks and guard on their flags: no hooks, the forward runs whole."""
    rt = FakeCollectives()
    ddp = DataParallel(cast(nn.Module, torch.compile(nn.Sequential(nn.Linear(64, 8)))), rt, bucket_mb=0.1)
    assert not any(module._forward_pre_hooks for module in ddp.module.modules())


def test_every_replica_takes_seat_0s_parameters_and_buffers() -> None:
    seat0 = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8).double(), nn.Linear(8, 2))
    seat0[1].running_mean.fill_(3.0)  # a buffer of another dtype, and an integer one (num_batches_tracked)
    seat0[1].num_batches_tracked.fill_(7)
    sent: list[torch.Tensor] = []
    DataParallel(seat0, FakeCollectives(), bucket_mb=0.1).take_seat0_state(lambda flat: sent.append(flat.clone()))
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8).double(), nn.Linear(8, 2))  # another initialization
    received = iter(sent)
    DataParallel(other, FakeCollectives(), bucket_mb=0.1).take_seat0_state(lambda flat: flat.copy_(next(received)))
    for mine, theirs in zip(other.state_dict().values(), seat0.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
