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
averaged values) with one fixed layout: every gradient goes into one flat
buffer in parameter order, one all-reduce runs at the end of backward, issued
asynchronously and waited on interruptibly by the runtime.  The wrapper holds
no process group: it asks the runtime for the current one, so a rebuilt group
is picked up with nothing to rebuild here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from deadpool.runtime import Runtime


class DataParallel(nn.Module):
    """Wraps a module; its parameters' gradients are averaged across seats after each backward."""

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        super().__init__()
        self.module = module
        self._runtime = runtime
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._flat = torch.zeros(sum(p.numel() for p in self._params), dtype=torch.float32)
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in self._params):
            self._flat = torch.zeros(0)
        self._queued = False
        for param in self._params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, _: torch.Tensor) -> None:
        self._runtime._chaos_point("backward")
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        if not self._runtime._average_gradients(self._params, self._flat):
            self._flat = torch.zeros_like(self._flat)  # the abandoned all-reduce may still write into the old one
