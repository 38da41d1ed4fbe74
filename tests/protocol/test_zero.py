"""ZeroShard without a job: torch's ZeroRedundancyOptimizer in a world of one; a shard loads only into its seat."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore
from torch.distributed.optim import ZeroRedundancyOptimizer

from deadpool.errors import MisuseError, RestoreFailed
from deadpool.worker import zero as zero_mod


@pytest.fixture(autouse=True)
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make(seed: int = 0, **options: bool) -> tuple[torch.nn.Module, zero_mod.ZeroShard]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, zero_mod.ZeroShard(ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                                             **options))


def step(model: torch.nn.Module, shard: zero_mod.ZeroShard) -> None:
    model(torch.ones(2, 8)).sum().backward()
    shard.zero.step()
    shard.zero.zero_grad()


def test_is_zero_tells_a_zero_optimizer_from_a_plain_one() -> None:
    _, shard = make()
    assert zero_mod.is_zero(shard.zero)
    assert not zero_mod.is_zero(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_shard_round_trip_restores_state_and_hyperparameters() -> None:
    model, shard = make()
    step(model, shard)
    shard.zero.param_groups[0]["lr"] = 0.5  # what an LR scheduler does between steps
    saved = shard.state_dict()

    _, spare = make(seed=1)
    spare.load_state_dict(saved)
    assert spare.zero.param_groups[0]["lr"] == 0.5 == spare.local.param_groups[0]["lr"]
    assert spare.local.state, "the shard's Adam moments came back"
    for (pa, sa), (pb, sb) in zip(shard.local.state.items(), spare.local.state.items(), strict=True):
        assert pa.shape == pb.shape
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_shard_of_another_seat_is_refused() -> None:
    model, shard = make()
    step(model, shard)
    saved = {**shard.state_dict(), "rank": 1, "world_size": 2}
    with pytest.raises(RestoreFailed, match="rank 1/2 cannot load into rank 0/1"):
        shard.load_state_dict(saved)


def test_overlap_with_ddp_is_refused() -> None:
    with pytest.raises(MisuseError, match="overlap_with_ddp"):
        make(overlap_with_ddp=True)
