"""A training script written for torchrun, converted to DeadPool.

Every line marked ``# deadpool`` is a change; the torchrun original is kept
beside it as a comment.  Everything else (the env contract, the model, the
optimizer, the loss, the rank-0 logging) is the torchrun script as it was,
and a cluster script changes only its command line:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 train.py      (before)
    deadpool launch --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --spares 1 train.py

Two things differ in kind, not just in name.  The loop is ``rt.steps()``:
spares wait inside it, and after a swap it rewinds to the restored step.  And
the batch comes from ``rt.rank``, not the ``RANK`` read at start-up: a spare
starts with ``RANK=-1`` and learns its seat only when it is adopted.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import deadpool  # deadpool

# import torch.distributed as dist
# from torch.nn.parallel import DistributedDataParallel as DDP


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of step `step`: a pure function of (step, rank), as a sampler's position would be."""
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(size, 16, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    # torchrun's environment contract, read the usual way.
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    torch.set_num_threads(1)

    # dist.init_process_group("gloo")
    rt = deadpool.init()  # deadpool
    print(f"env: RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank} MASTER={master}", flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    rt.track(model=model, optimizer=optimizer)  # deadpool
    ddp = rt.ddp(model)  # deadpool   (was: ddp = DDP(model))

    for step in rt.steps(args.steps):  # deadpool   (was: for step in range(args.steps):)
        x, y = batch(step, rt.rank)  # deadpool   (was: batch(step, rank))
        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rt.report(loss=loss.item())  # deadpool   (optional: the loss goes into the events file)
        if rt.rank == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)

    # dist.destroy_process_group()
    rt.finish()  # deadpool


if __name__ == "__main__":
    main()
