"""Data-parallel gradient averaging that survives a swap and stays bit-identical.

Why not ``torch.nn.parallel.DistributedDataParallel``: it re-buckets gradients
after its first iteration, and a floating-point ring all-reduce sums each
element in an order that depends on where it sits in its bucket.  A DDP
rebuilt after a swap starts with the initial bucketing again, so the steps
right after recovery would sum in a different order than the failure-free
run, and the final model would differ in its last bits.  It also waits for
its collectives inside C++, where an interrupt cannot reach.

This wrapper keeps DDP's contract (gradients are averaged when
``loss.backward()`` returns, so clipping and logging after backward see the
averaged values) with a layout that never changes: the parameters, in reverse
order (roughly the order backward produces their gradients), are packed into
fixed buckets of about ``bucket_mb``.  A bucket's all-reduce is issued as soon
as its last gradient is ready, in bucket order on every seat, so communication
overlaps the rest of backward as in DDP; the runtime waits for all of them
interruptibly at the end of backward.  The layout depends only on the
parameters' order, shapes and dtypes, so a seat rebuilt after a swap sums every
element in the same order as before.

The default bucket is DDP's 25 MB.  Smaller buckets overlap more, but each
gloo all-reduce costs CPU of its own (on the 2-core benchmark host, 2 MB
buckets, 7 all-reduces per step for the demo, cost 8% more CPU than one),
and where the cores are all busy that CPU is wall time.

After backward each ``param.grad`` is a view into its bucket (DDP's
``gradient_as_bucket_view``): no copy back, and a gradient accumulated in place
(``zero_grad(set_to_none=False)``) is already where the next all-reduce reads it.
The wrapper holds no process group: it asks the runtime for the current one, so
a rebuilt group is picked up with nothing to rebuild here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deadpool.chaos import ChaosPoint

if TYPE_CHECKING:
    from torch.distributed import Work

    from deadpool.worker.runtime import Runtime

DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb: the demo's 13 MB of gradients are one bucket


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


class DataParallel(nn.Module):
    """Wraps a module; its parameters' gradients are averaged across seats after each backward."""

    def __init__(self, module: nn.Module, runtime: Runtime, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        self._runtime = runtime
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [Bucket.of(group) for group in plan_buckets(params, int(bucket_mb * (1 << 20)))]
        self._bucket_of = {id(p): bucket for bucket in self._buckets for p in bucket.params}
        self._next = 0  # the next bucket to issue: buckets are issued in order on every seat
        self._backward = -1  # autograd's id of the backward in progress (-1: none)
        self._abandoned = False  # this backward's step is poisoned: nothing more is issued
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._runtime._chaos_point(ChaosPoint.BACKWARD)
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
        bucket.work = self._runtime._issue_allreduce(bucket.flat)
        if bucket.work is None:
            self._abandoned = True

    def _end_of_backward(self) -> None:
        self._backward = -1
        while self._next < len(self._buckets):
            self._issue(self._buckets[self._next])  # parameters that got no gradient in this backward
        works = [b.work for b in self._buckets if b.work is not None]
        if not self._abandoned and self._runtime._await_allreduces(works):
            divisor = self._runtime.world_size
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

    def _sever(self, bucket: Bucket) -> None:
        """After an abandoned all-reduce: nothing live may keep pointing into the buffer it was given."""
        for param in bucket.params:
            if bucket.aliases(param.grad):
                assert param.grad is not None
                param.grad = param.grad.clone()
        bucket.renew()
