"""Train a small Llama-style decoder under DeadPool: FSDP2 and tensor parallel with torch's own APIs.

    deadpool launch --nproc 4 --spares 1 --chaos kill:rank=2:step=13 demos/train_llama.py --fsdp --tp 2 --steps 30

`--fsdp` shards every block and the rest with ``fully_shard`` over the mesh's "dp" dimension;
`--tp N` splits attention heads and the MLP with ``ColwiseParallel``/``RowwiseParallel`` over
a "tp" dimension of size N; with neither the model trains on ``rt.ddp``.  The mesh comes from
``rt.device_mesh``; everything else is the plain torch code.  Deterministic for a seed: batches
depend only on (seed, step, data-parallel coordinate), so a run with failures ends with the same
final state digest as a run without them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import SIZES, build_model, clip_grad_norm, count_parameters, get_batch, load_corpus, lr_lambda, shard

import deadpool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank per step")
    parser.add_argument("--block", type=int, default=64, help="context length")
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp", action="store_true", help="fully_shard over the data-parallel dimension")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (a divisor of --nproc)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    # DTensor warns, once per process, that the clipping norm over the 2-D mesh takes two all-reduces.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rt = deadpool.init()
    if rt.world_size % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the job's {rt.world_size} seats")
    corpus = load_corpus()
    model = build_model(args.size, seed=args.seed)
    params = count_parameters(model)
    sharded = args.fsdp or args.tp > 1
    if sharded:
        mesh = rt.device_mesh((rt.world_size // args.tp, args.tp), ("dp", "tp"))  # a spare waits here for its seat
        shard(model, dp_mesh=mesh["dp"] if args.fsdp else None, tp_mesh=mesh["tp"] if args.tp > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=args.steps))
    rt.track(model=model, optimizer=optimizer, sched=scheduler)
    forward = model if sharded else rt.ddp(model)
    if not rt.is_spare and rt.rank == 0:
        print(f"model: {params / 1e6:.2f}M parameters, {args.steps} steps, "
              f"{'FSDP2' if args.fsdp else 'no FSDP'}, tp {args.tp}", flush=True)

    tokens = args.batch * args.block
    last = time.perf_counter()
    for step in rt.steps(args.steps):
        dp_rank = mesh["dp"].get_local_rank() if sharded else rt.rank
        inputs, targets = get_batch(corpus, step, dp_rank, args.batch, args.block, args.seed)
        _, loss = forward(inputs, targets)
        loss.backward()
        if args.clip:
            clip_grad_norm(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        now = time.perf_counter()
        rt.report(loss=loss.item(), tokens=tokens)
        if rt.rank == 0:
            rate = tokens * (rt.world_size // args.tp) / (now - last)  # every data-parallel rank's batch
            print(f"step {step:4d}  loss {loss.item():.4f}  {rate:8.0f} tok/s", flush=True)
        last = now
    rt.finish()


if __name__ == "__main__":
    main()
