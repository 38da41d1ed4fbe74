"""ZeroRedundancyOptimizer under DeadPool: a seat's optimizer shard lives only on that seat and its buddy.

torch's own optimizer, built once the member knows its seat, on torch's default group
(``groups.DefaultGroup``: the same object across views, its collectives on the current
view's group), so its post-step broadcast survives swaps unchanged.  ``ZeroShard`` is what a
snapshot holds of it: this seat's shard, through public attributes only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from deadpool.errors import MisuseError, RestoreFailed

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Imported only where a ZeRO optimizer exists: ``torch.distributed.optim`` pulls in FSDP and DTensor,
# about a CPU-second per process, which every worker (and spare) would pay at startup.
_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def is_zero(obj: object) -> bool:
    module = sys.modules.get(_ZERO_MODULE)  # not loaded: nothing in this process can be a ZeRO optimizer
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


class ZeroShard:
    """What DeadPool tracks for a ZeRO optimizer: this seat's shard of the optimizer state."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        if getattr(zero, "_overlap_with_ddp", False):
            raise MisuseError("ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported under DeadPool")
        self.zero = zero

    @property
    def local(self) -> torch.optim.Optimizer:
        """The optimizer over this seat's parameters only (its state is the shard)."""
        optim: torch.optim.Optimizer = self.zero.optim
        return optim

    def state_dict(self) -> dict[str, Any]:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.zero.param_groups]
        return {"rank": self.zero.rank, "world_size": self.zero.world_size, "local": self.local.state_dict(),
                "param_groups": hyper}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a shard saved by this very seat (rank and world size).

        Raises:
            RestoreFailed: the shard belongs to another seat or world size.
        """
        zero = self.zero
        if (state["rank"], state["world_size"]) != (zero.rank, zero.world_size):
            raise RestoreFailed(
                f"ZeRO shard of rank {state['rank']}/{state['world_size']} cannot load into "
                f"rank {zero.rank}/{zero.world_size}"
            )
        self.local.load_state_dict(state["local"])
        for exposed, local, saved in zip(zero.param_groups, self.local.param_groups, state["param_groups"],
                                         strict=True):
            exposed.update(saved)  # what an LR scheduler set, on both sides (as ZeRO's own load does)
            local.update(saved)
