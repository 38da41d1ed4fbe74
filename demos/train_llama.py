"""Train a small Llama-style decoder under DeadPool: FSDP2 and tensor parallel with torch's own APIs.

    deadpool launch --nproc 4 --spares 1 --chaos kill:rank=2:step=13 demos/train_llama.py --fsdp --tp 2 --steps 30

    deadpool launch --nproc 4 --spares 1 --chaos kill:rank=1:step=9:at=forward demos/train_llama.py --pp 2 --steps 30

`--fsdp` shards every block and the rest with ``fully_shard`` over the mesh's "dp" dimension;
`--tp N` splits attention heads and the MLP with ``ColwiseParallel``/``RowwiseParallel`` over
a "tp" dimension of size N; `--pp N` cuts the blocks into N pipeline stages run by
``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe`` or ``--schedule 1f1b``) over a
"pp" dimension, the stages' gradients averaged over "dp" (by FSDP2 with `--fsdp`, else one
all-reduce); with none of them the model trains on ``rt.ddp``.  The mesh comes from
``rt.device_mesh``; everything else is the plain torch code.  `--save-every N` saves a
``torch.distributed.checkpoint`` of the model and optimizer every N steps, as torchtitan does (a
failure during a save is recovered like one anywhere in the step).  Deterministic for a seed: batches
depend only on (seed, step, data-parallel coordinate), so a run with failures ends with the same
final state digest as a run without them.  `--device cuda` trains on GPU ``LOCAL_RANK % device count``
with deterministic kernels (``demos/gpt.py``'s ``pick_device``), the mesh's tensors on CUDA.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist
from gpt import pick_device
from llama import (
    SIZES,
    Stage,
    build_model,
    clip_grad_norm,
    count_parameters,
    get_batch,
    lm_loss,
    load_corpus,
    lr_lambda,
    shard,
)

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
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (a divisor of --nproc and of the layers)")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="the pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches per step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--save-every", type=int, default=0, help="a torch.distributed.checkpoint every N steps")
    parser.add_argument("--save-dir", default="checkpoints", help="where --save-every writes (a folder per step)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model trains; cuda: GPU LOCAL_RANK %% device count, deterministic kernels")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)  # before any CUDA work: it turns on deterministic kernels
    # DTensor warns, once per process, that the clipping norm over the 2-D mesh takes two all-reduces.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rt = deadpool.init()
    if rt.world_size % (args.tp * args.pp):
        raise SystemExit(f"--tp {args.tp} x --pp {args.pp} does not divide the job's {rt.world_size} seats")
    dp = rt.world_size // (args.tp * args.pp)
    corpus = load_corpus()
    model = build_model(args.size, seed=args.seed).to(device)  # on the device before it is sharded
    params = count_parameters(model)
    sharded = args.fsdp or args.tp > 1 or args.pp > 1
    schedule: Any = None  # a torch.distributed.pipelining schedule with --pp
    if sharded:  # a spare waits in rt.device_mesh for its seat
        mesh = rt.device_mesh((args.pp, dp, args.tp), ("pp", "dp", "tp"), device_type=device.type) if args.pp > 1 \
            else rt.device_mesh((dp, args.tp), ("dp", "tp"), device_type=device.type)
        if args.pp > 1:
            stage_index = mesh["pp"].get_local_rank()
            model = Stage(model, stage_index, args.pp)  # this seat's stage: the rest of the model is dropped
        shard(model, dp_mesh=mesh["dp"] if args.fsdp else None, tp_mesh=mesh["tp"] if args.tp > 1 else None)
        if args.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # about a second

            shapes = stage_shapes(stage_index, args.pp, args.batch // args.microbatches, args.block, SIZES[args.size])
            stage = PipelineStage(model, stage_index, args.pp, device, group=mesh["pp"].get_group(), **shapes)
            kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
            schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=args.steps))
    rt.track(model=model, optimizer=optimizer, sched=scheduler)
    forward = model if sharded else rt.ddp(model)
    if not rt.is_spare and rt.rank == 0:
        print(f"model: {params / 1e6:.2f}M parameters, {args.steps} steps, "
              f"{'FSDP2' if args.fsdp else 'no FSDP'}, tp {args.tp}, pp {args.pp}", flush=True)

    if args.save_every:
        import torch.distributed.checkpoint as dcp  # half a second of imports
        from torch.distributed.checkpoint.state_dict import get_state_dict
    tokens = args.batch * args.block
    last = time.perf_counter()
    for step in rt.steps(args.steps):
        dp_rank = mesh["dp"].get_local_rank() if sharded else rt.rank
        inputs, targets = (t.to(device) for t in get_batch(corpus, step, dp_rank, args.batch, args.block, args.seed))
        if schedule is not None:
            loss = pipeline_step(schedule, model, inputs, targets, mesh, average=dp > 1 and not args.fsdp)
        else:
            _, loss = forward(inputs, targets)
            loss.backward()
        if args.clip:
            clip_grad_norm(model.parameters(), args.clip, mesh["pp"].get_group() if args.pp > 1 else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if args.save_every and (step + 1) % args.save_every == 0:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{args.save_dir}/step{step}")
        now = time.perf_counter()
        if loss is not None:  # the last pipeline stage has the loss; every seat without a pipeline
            rt.report(loss=loss.item(), tokens=tokens)
            if dp_rank == 0 and (not sharded or mesh["tp"].get_local_rank() == 0):  # one seat prints
                rate = tokens * dp / (now - last)  # every data-parallel rank's batch
                print(f"step {step:4d}  loss {loss.item():.4f}  {rate:8.0f} tok/s", flush=True)
        last = now
    rt.finish()


def stage_shapes(index: int, stages: int, micro: int, block: int, cfg: Any) -> dict[str, Any]:
    """A pipeline stage's input and output shapes (and their gradients'), so that it infers none: inferring them
    runs a real forward and backward in the schedule's set-up, FSDP2's collectives included (docs/guide/sharded.md)."""
    hidden = torch.empty(micro, block, cfg.dim, requires_grad=index > 0)
    first, last = index == 0, index == stages - 1
    return {"input_args": (torch.empty(micro, block, dtype=torch.long) if first else hidden,),
            "output_args": (torch.empty(micro, block, cfg.vocab) if last else hidden,),
            "input_grads": None if first else (hidden,), "output_grads": None if last else (hidden,)}


def pipeline_step(schedule: Any, stage_model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                  mesh: Any, average: bool) -> torch.Tensor | None:
    """One step of this seat's pipeline stage (forward and backward of every microbatch), its gradients averaged
    over the data-parallel dimension when FSDP2 does not; the mean microbatch loss on the last stage, else None."""
    stage = mesh["pp"].get_local_rank()
    losses: list[torch.Tensor] = []
    if stage == 0:
        schedule.step(inputs)
    elif stage == mesh["pp"].size() - 1:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    if average:
        grads = [p.grad for p in stage_model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=mesh["dp"].get_group())
        flat /= mesh["dp"].size()
        pieces = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads, strict=True)])
    return torch.stack([loss.detach() for loss in losses]).mean() if losses else None


if __name__ == "__main__":
    main()
