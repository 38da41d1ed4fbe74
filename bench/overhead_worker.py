"""One training script for every row of bench/overhead.py: the same model, data and optimizer in every mode.

Modes:

- ``ddp``: plain ``torch.nn.parallel.DistributedDataParallel`` on gloo, no checkpoint (the baseline).
- ``deadpool``: started by ``deadpool launch``; ``rt.track`` + ``rt.ddp`` + ``rt.steps``.  The
  launcher's ``--snapshot-every`` decides whether snapshots are taken (the driver runs it twice:
  every step, and effectively never, to separate the snapshot cost from the all-reduce).
- ``torch_save``: DDP, and rank 0 ``torch.save``s model + optimizer (+ scheduler, RNG) every step,
  blocking (what most scripts do).
- ``dcp_save``: DDP, and every rank calls ``torch.distributed.checkpoint.save`` every step.
- ``dcp_async_save``: DDP, and every rank calls ``torch.distributed.checkpoint.async_save`` every
  step, first waiting for the previous save's future.
- ``fsdp`` / ``fsdp_tp``: the Llama demo's model (demos/llama.py) under torch's own FSDP2 (4-way) or
  FSDP2 x tensor parallel (2x2), on a mesh from ``init_device_mesh`` over gloo.  ``deadpool`` with
  ``--shard fsdp`` or ``--shard fsdp_tp`` is the same model on ``rt.device_mesh``.

Non-DeadPool modes read the torchrun env contract (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); rank 0 hosts the TCPStore on a socket bound to 127.0.0.1 only (a plain
``TCPStore`` server listens on every interface).

Step time is the wall time from the start of one step to the start of the next on rank 0
(``time.perf_counter``), so it includes everything the framework does between steps: DeadPool
captures its snapshot inside ``rt.steps()`` between two iterations, which a timer around the loop
body alone would not see.  The script runs ``warmup + steps + 1`` steps so that the last measured
step has a successor; rank 0 writes the per-step times (and, for DeadPool, ``rt.stats()``) to
``--out``, and every rank writes its CPU time per measured step to ``OUT.cpuRANK``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))

import llama  # noqa: E402
from gpt import build_model, count_parameters, get_batch, load_corpus, lr_lambda, pick_device  # noqa: E402

MODES = ("ddp", "deadpool", "torch_save", "dcp_save", "dcp_async_save", "fsdp", "fsdp_tp")
SHARDS = ("none", "fsdp", "fsdp_tp")  # how the model is parallelized: rt.ddp / DDP, or a mesh
PG_TIMEOUT_S = 120.0  # bounds every collective and the rendezvous of the non-DeadPool modes
SAVE_TIMEOUT_S = 120.0  # bounds the wait for an async save's future


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--steps", type=int, default=60, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=10, help="steps not measured")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (the demo's)")
    parser.add_argument("--block", type=int, default=64, help="context length (the demo's)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU LOCAL_RANK %% device count (gloo still carries the all-reduce)")
    parser.add_argument("--shard", choices=SHARDS, default="none",
                        help="deadpool mode: the Llama model on rt.device_mesh (fsdp: 4-way; fsdp_tp: 2x2)")
    parser.add_argument("--ckpt-dir", default="",
                        help="where checkpoints go (shared by all ranks; the caller removes it)")
    parser.add_argument("--out", required=True, help="JSON result file, written by rank 0")
    return parser.parse_args()


def _loopback_store(rank: int, world: int, port: int) -> torch.distributed.TCPStore:
    """The rendezvous store, its server listening on 127.0.0.1 only (via an already bound socket)."""
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    if rank != 0:
        return torch.distributed.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return torch.distributed.TCPStore(
        "127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=sock.detach(), use_libuv=True
    )


class Saver:
    """Per-step checkpoint of one baseline mode; ``save`` returns the seconds it blocked the loop."""

    def __init__(self, mode: str, rank: int, directory: Path, model: torch.nn.Module, ddp: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.mode = mode
        self.rank = rank
        self.directory = directory
        self.model, self.ddp, self.optimizer, self.scheduler = model, ddp, optimizer, scheduler
        self.future: Any = None
        self.group: Any = None
        if mode in ("dcp_save", "dcp_async_save"):
            # A group of its own: async_save runs collectives from a background thread, and gloo
            # collectives of two threads on one group would interleave differently on each rank.
            self.group = torch.distributed.new_group(backend="gloo")

    def _dcp_state(self) -> dict[str, Any]:
        """The documented DCP recipe: FQN-keyed model and optimizer state (DDP prefix stripped)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.ddp, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "sched": self.scheduler.state_dict(),
                "rng": torch.get_rng_state()}

    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        if self.mode == "torch_save":
            if self.rank == 0:
                state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "sched": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
                torch.save(state, self.directory / "checkpoint.pt")
        elif self.mode == "dcp_save":
            dcp.save(self._dcp_state(), checkpoint_id=str(self.directory / "dcp"), process_group=self.group)
        elif self.mode == "dcp_async_save":
            if self.future is not None:
                self.future.result(timeout=SAVE_TIMEOUT_S)
            self.future = dcp.async_save(self._dcp_state(), checkpoint_id=str(self.directory / "dcp"),
                                         process_group=self.group)
        return time.perf_counter() - started

    def close(self) -> None:
        """Let the last async save finish (outside the measured steps) before the group goes."""
        if self.future is not None:
            self.future.result(timeout=SAVE_TIMEOUT_S)
            self.future = None

    def nbytes(self) -> int:
        """Bytes of one checkpoint on disk: the whole job's (DCP writes each rank's share)."""
        return sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())


def _name_os_threads() -> None:
    """Give Python threads their names at the OS level (Python 3.11 does not), for the CPU breakdown."""
    for thread in threading.enumerate():
        if thread.native_id is None or thread is threading.main_thread():
            continue
        try:
            Path(f"/proc/self/task/{thread.native_id}/comm").write_text(thread.name[:15])
        except OSError:
            continue  # not Linux, or the thread ended meanwhile


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process so far, by thread name (Linux /proc; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return totals
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = name.rstrip("0123456789/")  # pool threads with numbered names count together
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return totals


class CpuClock:
    """This process's CPU time (all threads: copy, runtime, gloo, ZeroMQ) over the measured steps.

    Wall time on a 2-core host shared by 4 ranks depends on whatever else runs; CPU time per
    step is the work a system adds, and stays comparable when the host is busy.  Every rank
    writes its own figure, and a per-thread breakdown (which thread does the extra work), next
    to rank 0's result file.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.first, self.last = args.warmup, args.warmup + args.steps
        self.out = args.out
        self.began = self.ended = 0.0
        self.threads_began: dict[str, float] = {}
        self.threads_ended: dict[str, float] = {}

    def at(self, step: int) -> None:
        if step == self.first:
            _name_os_threads()
            self.began = time.process_time()
            self.threads_began = _thread_cpu()
        elif step == self.last:
            self.ended = time.process_time()
            self.threads_ended = _thread_cpu()

    def write(self, rank: int) -> None:
        steps = self.last - self.first
        per_step = (self.ended - self.began) / steps if self.ended and steps > 0 else 0.0
        threads = {name: round((t - self.threads_began.get(name, 0.0)) / max(1, steps), 6)
                   for name, t in self.threads_ended.items()}
        Path(f"{self.out}.cpu{rank}").write_text(json.dumps(
            {"rank": rank, "cpu_s_per_step": per_step, "threads_cpu_s_per_step": threads}))


def _train_step(step: int, rank: int, args: argparse.Namespace, corpus: torch.Tensor, ddp: torch.nn.Module,
                optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """The demo's step body (demos/train_gpt.py), unchanged; returns the loss."""
    inputs, targets = (t.to(args.torch_device) for t in get_batch(corpus, step, rank, args.batch, args.block,
                                                                    args.seed))
    _, loss = ddp(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(loss.item())


def _summary(args: argparse.Namespace, starts: list[float], bodies: list[float], losses: list[float],
             params: int, world: int) -> dict[str, Any]:
    periods = [b - a for a, b in itertools.pairwise(starts)]
    return {
        "mode": args.mode, "size": args.size, "params": params, "world_size": world,
        "warmup": args.warmup, "steps": args.steps,
        "snapshot_every": int(os.environ.get("DEADPOOL_SNAPSHOT_EVERY", "0") or 0),
        "threads": torch.get_num_threads(), "device": str(args.torch_device),
        "gpu": torch.cuda.get_device_name(args.torch_device) if args.torch_device.type == "cuda" else "",
        "step_s": periods, "body_s": bodies[: len(periods)], "loss": losses,
    }


def _mesh_shape(shard: str, world: int) -> tuple[int, int]:
    tp = 2 if shard == "fsdp_tp" else 1
    return world // tp, tp


def _sharded_llama(args: argparse.Namespace, mesh: Any, total: int) -> tuple[Any, Any, Any, int]:
    """The Llama demo's model sharded over `mesh` (dims dp, tp): model, optimizer, scheduler, data rank."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model = llama.build_model("small", seed=args.seed)
    llama.shard(model, dp_mesh=mesh["dp"], tp_mesh=mesh["tp"] if mesh["tp"].size() > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=total))
    return model, optimizer, scheduler, mesh["dp"].get_local_rank()


def run_deadpool(args: argparse.Namespace) -> None:
    """DeadPool mode: the demo's loop under ``rt.steps`` (snapshot cadence comes from the launcher)."""
    import deadpool

    total = args.warmup + args.steps + 1
    rt = deadpool.init()
    corpus = load_corpus()
    if args.shard == "none":
        model = build_model(args.size, seed=args.seed).to(args.torch_device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=total))
        data_rank = -1
    else:
        mesh = rt.device_mesh(_mesh_shape(args.shard, rt.world_size), ("dp", "tp"))
        model, optimizer, scheduler, data_rank = _sharded_llama(args, mesh, total)
    torch.manual_seed(args.seed + 1000 + max(0, int(os.environ.get("RANK", "0"))))
    rt.track(model=model, optimizer=optimizer, sched=scheduler)
    ddp = rt.ddp(model) if args.shard == "none" else model
    starts: list[float] = []
    bodies: list[float] = []
    losses: list[float] = []
    cpu = CpuClock(args)
    spare = rt.is_spare  # with --audit it re-does the seats' steps in this loop: it times nothing
    for step in rt.steps(total):
        started = time.perf_counter()
        starts.append(started)
        if not spare:
            cpu.at(step)
        losses.append(_train_step(step, rt.rank if data_rank < 0 else data_rank, args, corpus, ddp, optimizer,
                                  scheduler))
        bodies.append(time.perf_counter() - started)
    if spare:
        rt.finish()
        return
    rank, world = rt.rank, rt.world_size
    cpu.write(rank)
    stats = rt.stats()
    rt.finish()
    if rank == 0:
        result = _summary(args, starts, bodies, losses, count_parameters(model), world)
        result["stats"] = stats
        # stall_s holds one entry per gated step (the last 200; the final step is the unmeasured extra one).
        stalls = stats["stall_s"][-(args.steps + 1):][: args.steps] if len(stats["stall_s"]) > args.steps else []
        result["stall_s"] = stalls
        result["snapshot_bytes"] = stats["snapshot_bytes"] if result["snapshot_every"] <= total else 0
        Path(args.out).write_text(json.dumps(result))


def run_torch(args: argparse.Namespace) -> None:
    """Plain DDP modes, with or without a per-step checkpoint."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _loopback_store(rank, world, int(os.environ["MASTER_PORT"]))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                         timeout=timedelta(seconds=PG_TIMEOUT_S))
    total = args.warmup + args.steps + 1
    corpus = load_corpus()
    data_rank = rank
    if args.mode in ("fsdp", "fsdp_tp"):  # torch's own mesh over gloo: what a sharded script writes
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", _mesh_shape(args.mode, world), mesh_dim_names=("dp", "tp"))
        model, optimizer, scheduler, data_rank = _sharded_llama(args, mesh, total)
        ddp = model
    else:
        model = build_model(args.size, seed=args.seed).to(args.torch_device)
        on_gpu = args.torch_device.type == "cuda"
        ddp = DistributedDataParallel(model, device_ids=[args.torch_device.index] if on_gpu else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=10, total=total))
    torch.manual_seed(args.seed + 1000 + rank)
    saver = None
    if args.mode in ("torch_save", "dcp_save", "dcp_async_save"):
        if not args.ckpt_dir:
            raise SystemExit(f"--mode {args.mode} needs --ckpt-dir (one directory shared by every rank)")
        directory = Path(args.ckpt_dir) / args.mode
        directory.mkdir(parents=True, exist_ok=True)
        saver = Saver(args.mode, rank, directory, model, ddp, optimizer, scheduler)
    starts: list[float] = []
    bodies: list[float] = []
    losses: list[float] = []
    stalls: list[float] = []
    try:
        cpu = CpuClock(args)
        for step in range(total):
            started = time.perf_counter()
            starts.append(started)
            cpu.at(step)
            losses.append(_train_step(step, data_rank, args, corpus, ddp, optimizer, scheduler))
            if saver is not None:
                stalls.append(saver.save())
            bodies.append(time.perf_counter() - started)
        if saver is not None:
            saver.close()
        cpu.write(rank)
        torch.distributed.barrier()
        if rank == 0:
            result = _summary(args, starts, bodies, losses, count_parameters(model), world)
            result["stall_s"] = stalls[args.warmup: args.warmup + args.steps]
            result["snapshot_bytes"] = saver.nbytes() if saver is not None else 0
            Path(args.out).write_text(json.dumps(result))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)  # the demo's setting: one intra-op thread per worker
    args.torch_device = pick_device(args.device)
    if args.mode == "deadpool":
        run_deadpool(args)
    else:
        run_torch(args)


if __name__ == "__main__":
    main()
