"""ZeroRedundancyOptimizer under DeadPool: a seat's optimizer shard lives only on that seat and its buddy.

``build()`` makes the optimizer outside any job-wide group and ``ZeroShard``
seats it in every view (re-partitioning like ZeRO would), snapshots its shard
and hands its post-step broadcast to the runtime.  The torch internals this
relies on are used here and nowhere else (see docs/architecture.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from deadpool.errors import MisuseError, RestoreFailed

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Imported only where a ZeRO optimizer exists: ``torch.distributed.optim`` pulls in FSDP and DTensor,
# about a CPU-second per process, which every worker (and spare) would pay at startup.
_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def build(
    params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], **defaults: Any,
) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` built outside any job-wide group, to be seated by the runtime.

    Raises:
        MisuseError: torch.distributed already has a default group (DeadPool scripts must not create one),
            or ``overlap_with_ddp`` was asked for.
    """
    if defaults.get("overlap_with_ddp"):
        raise MisuseError("rt.zero_optimizer(): overlap_with_ddp=True is not supported (it needs torch DDP's hooks)")
    if dist.is_initialized():
        raise MisuseError(
            "rt.zero_optimizer(): torch.distributed already has a default process group; under DeadPool "
            "the runtime owns the groups (do not call init_process_group)"
        )
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        return ZeroRedundancyOptimizer(params, optimizer_class, **defaults)
    finally:
        dist.destroy_process_group()


def is_zero(obj: object) -> bool:
    module = sys.modules.get(_ZERO_MODULE)  # not loaded: nothing in this process can be a ZeRO optimizer
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


class ZeroShard:
    """What DeadPool tracks for a ZeRO optimizer: this seat's shard, and the hook that seats it."""

    def __init__(self, zero: ZeroRedundancyOptimizer, broadcast: Callable[[ZeroShard], None]) -> None:
        if getattr(zero, "_overlap_with_ddp", False):
            raise MisuseError("ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported under DeadPool")
        self.zero = zero
        # ZeRO's step() ends with self._sync_params(); the runtime's broadcast replaces it on this instance.
        zero._sync_params = lambda: broadcast(self)  # type: ignore[attr-defined]

    @property
    def local(self) -> torch.optim.Optimizer:
        """The optimizer over this seat's parameters only (its state is the shard)."""
        optim: torch.optim.Optimizer = self.zero.optim
        return optim

    def seat(self, rank: int, world_size: int, group: Any) -> None:
        """Point the optimizer at (rank, world_size, group); re-partition if the seat or world changed."""
        zero: Any = self.zero
        zero.process_group = group
        if (zero.rank, zero.world_size) == (rank, world_size):
            return
        zero.rank, zero.global_rank, zero.world_size = rank, rank, world_size
        zero._clear_cache()
        zero._init_local_optimizer()
        zero._build_param_buckets()

    def shard_tensors(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(owner rank, tensor) for every tensor the post-step broadcast sends, in ZeRO's own order."""
        zero: Any = self.zero
        for rank in range(zero.world_size):
            if zero.parameters_as_bucket_view:
                for device_buckets in zero._buckets:
                    yield rank, device_buckets[rank]
            else:
                for group in zero._partition_parameters()[rank]:
                    for param in group["params"]:
                        yield rank, param.data

    def state_dict(self) -> dict[str, Any]:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.zero.param_groups]
        zero: Any = self.zero
        return {"rank": zero.rank, "world_size": zero.world_size, "local": self.local.state_dict(),
                "param_groups": hyper}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a shard saved by this very seat (rank and world size).

        Raises:
            RestoreFailed: the shard belongs to another seat or world size.
        """
        zero: Any = self.zero
        if (state["rank"], state["world_size"]) != (zero.rank, zero.world_size):
            raise RestoreFailed(
                f"ZeRO shard of rank {state['rank']}/{state['world_size']} cannot load into "
                f"rank {zero.rank}/{zero.world_size}"
            )
        self.local.load_state_dict(state["local"])
        for group, saved in zip(self.zero.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        zero._sync_param_groups(zero.param_groups, self.local.param_groups)  # exposed -> local, as ZeRO's own load
