"""``nn.SyncBatchNorm`` on CPU tensors: batch statistics synced over the default group, as torch does on GPU.

torch's SyncBatchNorm raises for a CPU input once a default group exists (its
statistics kernels are GPU-only), so a CPU script that uses it could not run
under DeadPool's default group.  ``enable()`` (called when that group is
installed) routes a CPU forward in training mode to the same computation in
plain tensor ops: the per-seat mean, variance and count are all-gathered on the
module's group (the default group unless it names one), the backward
all-reduces the two gradient sums, exactly the collectives torch's own version
issues.  Every other case (GPU inputs, eval mode, no group) is torch's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deadpool.worker.patches import PATCHES, SYNC_BATCH_NORM


def enable() -> None:
    """Route CPU training forwards of every ``nn.SyncBatchNorm`` here (idempotent)."""
    PATCHES.install(SYNC_BATCH_NORM, _routing)


def _routing(torch_forward: Callable[[nn.SyncBatchNorm, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu" or not self.training or not dist.is_initialized():
            return torch_forward(self, input)
        return _cpu_forward(self, input)

    return forward


def _cpu_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    # From here torch's forward would raise "SyncBatchNorm expected input tensor to be on GPU".
    self._check_input_dim(input)
    self._check_non_zero_input_channels(input)
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.track_running_stats:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked.item()) if self.momentum is None else self.momentum
    running_mean = self.running_mean if self.track_running_stats else None
    running_var = self.running_var if self.track_running_stats else None
    group = self.process_group if self.process_group else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, momentum, self.eps)
    output: torch.Tensor = _SyncBatchNorm.apply(  # type: ignore[no-untyped-call]
        input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, group, world)
    return output


def _shape(input: torch.Tensor) -> list[int]:
    """A per-channel vector's shape, broadcastable against `input` (channels in dimension 1)."""
    return [1, input.shape[1]] + [1] * (input.dim() - 2)


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalization over every seat's batch (torch's ``_functions.SyncBatchNorm`` in CPU ops)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, momentum: float,
        group: Any, world: int,
    ) -> torch.Tensor:
        input = input.contiguous()
        channels = input.shape[1]
        acc = torch.promote_types(input.dtype, torch.float32)  # statistics in at least float32, as torch's kernels
        x = input.to(acc)
        count = input.numel() // channels
        if count:
            mean = x.mean(_reduced_dims(x))
            var = x.var(_reduced_dims(x), correction=0)
        else:  # an empty batch still takes part in the collective, with a count of zero
            mean = var = torch.zeros(channels, dtype=acc)
        local = torch.cat([mean, var, torch.tensor([float(count)], dtype=acc)])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        stats = torch.stack(gathered)
        means, variances, counts = stats[:, :channels], stats[:, channels : 2 * channels], stats[:, 2 * channels :]
        total = counts.sum()
        mean = (means * counts).sum(0) / total
        var = ((variances + (means - mean).square()) * counts).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * (total / (total - 1)) if total > 1 else var
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.group, ctx.has_bias = total, group, bias is not None
        shape = _shape(input)
        output = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            output = output * weight.to(acc).view(shape)
        if bias is not None:
            output = output + bias.to(acc).view(shape)
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        input, weight, mean, invstd = ctx.saved_tensors
        shape, dims = _shape(input), _reduced_dims(input)
        acc = mean.dtype
        dy = grad_output.contiguous().to(acc)
        xmu = input.to(acc) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            combined = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(combined, group=ctx.group)
            mean_dy, mean_dy_xmu = (combined / ctx.total).split(input.shape[1])
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad = (dy - mean_dy.view(shape) - xmu * (invstd.square() * mean_dy_xmu).view(shape)) * scale.view(shape)
            grad_input = grad.to(input.dtype)
        # Like torch's: the weight's and bias's gradients stay local; data parallelism averages them.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
