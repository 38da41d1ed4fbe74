"""Data-parallel gradient averaging that survives a swap and stays bit-identical (``rt.ddp``).

Gradients are packed into fixed buckets (reverse parameter order, a layout that
depends only on the parameters, so a rebuilt seat sums every element in the
same order) and each bucket's all-reduce is issued through the runtime's
``StepCollectives`` as soon as its gradients are ready; as in torch's DDP,
``no_sync()`` accumulates gradients locally and module buffers are broadcast
from seat 0.  Why not torch's DDP is in docs/design/compute.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from deadpool.chaos import ChaosPoint
from deadpool.worker.lost_step import AbandonableForward, StepAbandoned

if TYPE_CHECKING:
    from torch.distributed import Work

    from deadpool.worker.groups.hub import StepCollectives

DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb: the demo's 13 MB of gradients are one bucket
# Buffers broadcast from seat 0 (DDP's broadcast_buffers): floating and integer ones.
INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
ALIGN = 8  # bytes: each buffer starts at a multiple of the largest element size in the packed broadcast


@dataclass
class Bucket:
    """Parameters whose gradients are all-reduced together, and the flat buffer that carries them."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)  # `flat` cut and shaped like each parameter
    ready: int = 0  # gradients of this backward that are ready
    work: Work | None = None  # the all-reduce in flight, once issued

    @classmethod
    def of(cls, params: list[nn.Parameter]) -> Bucket:
        bucket = cls(params, torch.empty(0, dtype=params[0].dtype, device=params[0].device))
        bucket.renew()
        return bucket

    @property
    def full(self) -> bool:
        """Every gradient of this bucket is ready: it can be issued."""
        return self.ready == len(self.params)

    def renew(self) -> None:
        """A fresh buffer: an abandoned all-reduce may still complete into the old one later."""
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=self.flat.dtype, device=self.flat.device)
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()

    def aliases(self, grad: torch.Tensor | None) -> bool:
        """The gradient already lives in this bucket (a view handed out by the previous backward)."""
        if grad is None or grad.device != self.flat.device:
            return False
        return grad.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Reverse parameter order, packed greedily up to `bucket_bytes` (one dtype and device per bucket).

    Deterministic in the parameters alone: every seat, and every seat rebuilt after a swap,
    gets the same layout, which is what keeps the summation order (and the bits) the same.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        kind_changed = bool(current) and (current[0].dtype, current[0].device) != (param.dtype, param.device)
        if current and (kind_changed or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def packed(tensors: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
    """Per device: one byte buffer holding a copy of each of `tensors` (each at a multiple of ``ALIGN``), the
    views of it shaped as their dtypes, and those tensors."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for device, group in by_device.items():
        offsets, total = [], 0
        for tensor in group:
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        views = [flat[at : at + t.numel() * t.element_size()].view(t.dtype)
                 for t, at in zip(group, offsets, strict=True)]
        with torch.no_grad():
            torch._foreach_copy_(views, [t.reshape(-1) for t in group])
        yield flat, views, group


class DataParallel(nn.Module):
    """Wraps a module; its parameters' gradients are averaged across seats after each backward."""

    def __init__(
        self, module: nn.Module, collectives: StepCollectives, bucket_mb: float = DEFAULT_BUCKET_MB,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._collectives = collectives
        self._require_sync = True  # False inside no_sync()
        self._sync_backward = True  # whether the backward of the last forward all-reduces (decided at forward)
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [Bucket.of(group) for group in plan_buckets(params, int(bucket_mb * (1 << 20)))]
        self._bucket_of = {id(p): bucket for bucket in self._buckets for p in bucket.params}
        self._next = 0  # the next bucket to issue: buckets are issued in order on every seat
        self._backward = -1  # autograd's id of the backward in progress (-1: none)
        self._abandoned = False  # this backward's step is poisoned: nothing more is issued
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)  # type: ignore[no-untyped-call]
        self._forward = AbandonableForward(module, collectives.step_lost)  # a lost step's forward stops early

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; after a training forward whose backward all-reduces, seat 0's buffers.

        torch's DDP broadcasts before the forward.  Every forward sees the same buffers either
        way (seat 0's, as the previous synced forward left them), but broadcasting after it
        also leaves every seat, and every seat's snapshot, with the same buffers at the end.
        """
        self._sync_backward = self._require_sync  # as DDP: the forward decides whether its backward syncs
        output = self._forward(self.module, *args, **kwargs)
        if self.broadcast_buffers and self._sync_backward and self.module.training and torch.is_grad_enabled():
            self._broadcast_buffers()
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards inside accumulate gradients locally, without all-reducing them.

        The first backward of a forward outside it all-reduces the accumulated sums, as in
        torch's DDP (run the forward inside the context too).  Accumulation happens in
        autograd's fixed order, so a replayed step gives the same bits.
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._collectives.fault_point(ChaosPoint.BACKWARD)
        if self._collectives.step_lost():
            raise StepAbandoned  # the rest of this backward computes nothing that counts (lost_step.py)
        if not self._sync_backward:
            return  # no_sync(): autograd accumulates into param.grad, the next synced backward sums it
        backward = torch._C._current_graph_task_id()
        if backward != self._backward:  # the first gradient of this backward
            self._backward = backward
            self._reset()  # in case the previous backward raised before its end
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._bucket_of[id(param)].ready += 1
        while self._next < len(self._buckets) and self._buckets[self._next].full:
            self._issue(self._buckets[self._next])

    def _issue(self, bucket: Bucket) -> None:
        """Pack the bucket's gradients (zeros for a parameter without one) and start its all-reduce."""
        self._next += 1
        if self._abandoned:
            return
        grads, targets = [], []
        for param, view in zip(bucket.params, bucket.views, strict=True):
            if param.grad is None:
                view.zero_()
            elif not bucket.aliases(param.grad):
                grads.append(param.grad)
                targets.append(view)
        if grads:
            torch._foreach_copy_(targets, grads)
        self._collectives.packed_gradient(bucket.flat)  # chaos may corrupt it; an audited step digests it
        bucket.work = self._collectives.issue_allreduce(bucket.flat)
        if bucket.work is None and not self._collectives.local_only():  # an audit packs every bucket, sums none
            self._abandoned = True

    def _end_of_backward(self) -> None:
        self._backward = -1
        while self._next < len(self._buckets):
            self._issue(self._buckets[self._next])  # parameters that got no gradient in this backward
        works = [b.work for b in self._buckets if b.work is not None]
        if not self._abandoned and self._collectives.await_allreduces(works):
            divisor = self._collectives.world_size
            for bucket in self._buckets:
                bucket.flat.div_(divisor)
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    if not bucket.aliases(param.grad):
                        param.grad = view
                bucket.work = None  # completed: nothing for _reset to sever
        self._reset()

    def _reset(self) -> None:
        """Ready for the next backward; a bucket still holding an all-reduce was abandoned."""
        for bucket in self._buckets:
            if bucket.work is not None:
                self._sever(bucket)
            bucket.ready, bucket.work = 0, None
        self._next, self._abandoned = 0, False

    def _broadcast_buffers(self) -> None:
        """Seat 0's floating and integer buffers to every seat: one packed broadcast per device.

        Received into a fresh buffer and copied into the module only once complete (an
        abandoned broadcast may still complete later); the copy keeps autograd's version
        counters, as DDP's does, since the forward that just ran may have saved a buffer.
        """
        if self._collectives.world_size < 2:
            return
        for flat, views, buffers in packed(self._synced_buffers()):
            if not self._collectives.broadcast_buffers(flat):
                return  # the step is poisoned: its buffers are rolled back anyway
            with torch.no_grad(), _unsafe_preserve_version_counter(tuple(buffers)):
                for buffer, view in zip(buffers, views, strict=True):
                    buffer.copy_(view.view(buffer.shape))

    def take_seat0_state(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        """Every seat takes seat 0's parameters and buffers, as torch's DDP does when it wraps a model: replicas of a
        script that does not seed its model's initialization start equal all the same (a snapshot holds only a slice
        of the replicated state, so unequal replicas would also come back mixed after a swap)."""
        for flat, views, tensors in packed([*self.module.parameters(), *self._synced_buffers()]):
            broadcast(flat)
            with torch.no_grad():
                for tensor, view in zip(tensors, views, strict=True):
                    tensor.copy_(view.view(tensor.shape))

    def _synced_buffers(self) -> list[torch.Tensor]:
        return [b for b in self.module.buffers() if b.numel() and (b.is_floating_point() or b.dtype in INTEGER_DTYPES)]

    def _sever(self, bucket: Bucket) -> None:
        """After an abandoned all-reduce: nothing live may keep pointing into the buffer it was given."""
        for param in bucket.params:
            if bucket.aliases(param.grad):
                assert param.grad is not None
                param.grad = param.grad.clone()
        bucket.renew()
