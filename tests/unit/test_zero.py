"""ZeroShard without a job: seating re-partitions exactly as ZeRO would, and a shard round-trips only into its seat."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import MisuseError, RestoreFailed
from deadpool.worker import zero as zero_mod


def make(seed: int = 0) -> tuple[torch.nn.Module, zero_mod.ZeroShard, list[object]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    zero = zero_mod.build(model.parameters(), torch.optim.AdamW, lr=1e-2)
    calls: list[object] = []
    return model, zero_mod.ZeroShard(zero, calls.append), calls


def step(model: torch.nn.Module, shard: zero_mod.ZeroShard) -> None:
    model(torch.ones(2, 8)).sum().backward()
    shard.zero.step()
    shard.zero.zero_grad()


def test_build_leaves_no_global_group_and_starts_as_a_world_of_one() -> None:
    _, shard, _ = make()
    assert not dist.is_initialized()
    zero = shard.zero
    assert (zero.rank, zero.world_size) == (0, 1)
    assert sum(p.numel() for g in shard.local.param_groups for p in g["params"]) == 8 * 16 + 16 + 16 * 4 + 4


def test_seat_partitions_like_zero_and_the_runtime_broadcasts() -> None:
    model, shard, calls = make()
    shard.seat(1, 3, None)
    local = {p.data_ptr() for g in shard.local.param_groups for p in g["params"]}
    owners = {t.data_ptr(): r for r, t in shard.shard_tensors()}
    assert local and local == {i for i, r in owners.items() if r == 1}
    assert set(owners.values()) <= {0, 1, 2} and len(owners) == len(list(model.parameters()))
    step(model, shard)
    assert calls == [shard], "ZeRO's own broadcast is replaced by the runtime's"
    assert all(p.data_ptr() in local for p in shard.local.state), "the local optimizer holds state for its shard only"


def test_shard_round_trip_restores_state_and_hyperparameters() -> None:
    model, shard, _ = make()
    shard.seat(1, 2, None)
    step(model, shard)
    shard.zero.param_groups[0]["lr"] = 0.5  # what an LR scheduler does between steps
    saved = shard.state_dict()

    spare_model, spare, _ = make()
    spare.seat(1, 2, None)  # the adopted spare takes the seat first, then loads the seat's shard
    spare.load_state_dict(saved)
    assert spare.zero.param_groups[0]["lr"] == 0.5 == spare.local.param_groups[0]["lr"]
    for (pa, sa), (pb, sb) in zip(shard.local.state.items(), spare.local.state.items(), strict=True):
        assert pa.shape == pb.shape
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_shard_of_another_seat_is_refused() -> None:
    model, shard, _ = make()
    shard.seat(0, 2, None)
    step(model, shard)
    _, other, _ = make()
    other.seat(1, 2, None)
    with pytest.raises(RestoreFailed, match="rank 0/2 cannot load into rank 1/2"):
        other.load_state_dict(shard.state_dict())


def test_overlap_with_ddp_is_refused() -> None:
    with pytest.raises(MisuseError, match="overlap_with_ddp"):
        zero_mod.build(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True)
