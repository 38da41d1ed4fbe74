"""Train a small GPT-style byte model data-parallel under DeadPool.

    deadpool launch --nproc 4 --spares 1 --chaos kill:rank=2:step=20 demos/train_gpt.py --steps 40

Deterministic for a given seed: batches depend only on (seed, step, rank), the
model starts from the same weights everywhere, and each worker computes with
one thread.  So a run with failures ends with the same final state digest as
a run without them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import build_model, count_parameters, get_batch, load_corpus, lr_lambda, pick_device  # noqa: E402

import deadpool  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--block", type=int, default=64, help="context length")
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer state across seats (torch ZeroRedundancyOptimizer)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model trains; cuda: GPU LOCAL_RANK %% device count, deterministic kernels")
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (slow tests)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    rt = deadpool.init()
    corpus = load_corpus()
    model = build_model(args.size, seed=args.seed).to(device)
    if args.zero:
        optimizer = rt.zero_optimizer(model.parameters(), torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=args.steps))
    torch.manual_seed(args.seed + 1000 + max(0, int(os.environ.get("RANK", "0"))))
    rt.track(model=model, optimizer=optimizer, sched=scheduler)
    ddp = rt.ddp(model)
    if not rt.is_spare:
        print(f"model: {count_parameters(model) / 1e6:.2f}M parameters, {args.steps} steps", flush=True)

    tokens = args.batch * args.block
    last = time.perf_counter()
    for step in rt.steps(args.steps):
        inputs, targets = (t.to(device) for t in get_batch(corpus, step, rt.rank, args.batch, args.block, args.seed))
        _, loss = ddp(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if args.step_delay:
            time.sleep(args.step_delay)
        now = time.perf_counter()
        rt.report(loss=loss.item(), tokens=tokens)
        if rt.rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  {tokens * rt.world_size / (now - last):8.0f} tok/s",
                  flush=True)
        last = now
    rt.finish()


if __name__ == "__main__":
    main()
