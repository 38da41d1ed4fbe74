"""One process set, two training paths: the worker of ``bench/overhead_injob.py``.

Run under ``deadpool launch --nproc 4 --spares 0``.  It builds the same model twice: once on
torch's own groups (``plain``: torch DDP, or FSDP2 / tensor parallel on a native gloo mesh),
once on DeadPool's (``rt.ddp`` or ``rt.device_mesh``, tracked).  Then it alternates blocks of
steps between three modes over the same data: ``plain``, ``deadpool`` (snapshot every step)
and ``nosnap`` (DeadPool's path, ``rt.set_snapshots(False)``).  Every rank writes each step's
wall time (from one step's start to the next one's) and its process's CPU time over the same
interval (every thread: the snapshot copy thread too), with the mode and block, to ``--out.RANK``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore
from torch.distributed.device_mesh import DeviceMesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "demos"))

import gpt  # noqa: E402
import llama  # noqa: E402

import deadpool  # noqa: E402

MODES = ("plain", "deadpool", "nosnap")


def native_group(store: TCPStore, ranks: list[int], rank: int, name: str) -> dist.ProcessGroup:
    """A native torch group of `ranks` (gloo), registered under `name`: what init_device_mesh would build."""
    prefix = PrefixStore(f"plain/{name}", store)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=120)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = ProcessGroupGloo(prefix, ranks.index(rank), len(ranks), options)
    group = dist.ProcessGroup(prefix, ranks.index(rank), len(ranks))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(name)
    c10d._register_pg_in_world(group, "gloo", prefix, name, "gloo",
                               rank_mapping={g: i for i, g in enumerate(ranks)})
    return group


def native_mesh(store: TCPStore, shape: tuple[int, int], rank: int) -> DeviceMesh:
    layout = torch.arange(shape[0] * shape[1]).view(*shape)
    dp_index, tp_index = divmod(rank, shape[1])
    dp = native_group(store, layout[:, tp_index].tolist(), rank, f"plain:dp:{tp_index}")
    tp = native_group(store, layout[dp_index].tolist(), rank, f"plain:tp:{dp_index}")
    return DeviceMesh.from_group([dp, tp], "cpu", mesh=layout, mesh_dim_names=("dp", "tp"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", choices=("ddp", "fsdp", "fsdp-tp"), required=True)
    parser.add_argument("--size", default="small")
    parser.add_argument("--block-steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--port", type=int, required=True, help="the plain path's store (rank 0 hosts it)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=0, help="ignored: the schedule decides")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rt = deadpool.init()
    rank, world = rt.rank, rt.world_size
    store = TCPStore("127.0.0.1", args.port, world, rank == 0, timeout=timedelta(seconds=120))
    corpus = gpt.load_corpus()

    models: dict[str, Any] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if args.parallel == "ddp":
        world_group = native_group(store, list(range(world)), rank, "plain:world")
        plain = gpt.build_model(args.size, seed=0)
        models["plain"] = torch.nn.parallel.DistributedDataParallel(plain, process_group=world_group)
        mine = gpt.build_model(args.size, seed=0)
        optimizers["plain"] = torch.optim.AdamW(plain.parameters(), lr=3e-4)
        optimizers["deadpool"] = torch.optim.AdamW(mine.parameters(), lr=3e-4)
        rt.track(model=mine, optimizer=optimizers["deadpool"])
        models["deadpool"] = rt.ddp(mine)
        dp_rank, batch = rank, 8
    else:
        tp = 2 if args.parallel == "fsdp-tp" else 1
        shape = (world // tp, tp)
        mesh = rt.device_mesh(shape, ("dp", "tp"))
        plain_mesh = native_mesh(store, shape, rank)
        for mode, on in (("plain", plain_mesh), ("deadpool", mesh)):
            model = llama.build_model(args.size, seed=0)
            llama.shard(model, dp_mesh=on["dp"], tp_mesh=on["tp"] if tp > 1 else None)
            models[mode] = model
            optimizers[mode] = torch.optim.AdamW(model.parameters(), lr=3e-4)
        rt.track(model=models["deadpool"], optimizer=optimizers["deadpool"])
        dp_rank, batch = mesh["dp"].get_local_rank(), 4
    models["nosnap"], optimizers["nosnap"] = models["deadpool"], optimizers["deadpool"]

    # Blocks cycle through the modes, the order rotated every round so no mode always follows another.
    schedule: list[tuple[str, int]] = []
    for round_ in range(args.rounds):
        for offset in range(len(MODES)):
            mode = MODES[(round_ + offset) % len(MODES)]
            schedule += [(mode, round_ * len(MODES) + offset)] * args.block_steps
    times: list[tuple[str, int, float, float]] = []  # mode, block, wall seconds, CPU seconds of this process
    started = cpu_started = None
    for step in rt.steps(len(schedule)):
        now, cpu = time.perf_counter(), time.process_time()
        if started is not None and cpu_started is not None:
            times.append((schedule[step - 1][0], schedule[step - 1][1], now - started, cpu - cpu_started))
        started, cpu_started = now, cpu
        mode, _ = schedule[step]
        rt.set_snapshots(mode == "deadpool")
        inputs, targets = gpt.get_batch(corpus, step, dp_rank, batch, 64)
        _, loss = models[mode](inputs, targets)
        loss.backward()
        optimizers[mode].step()
        optimizers[mode].zero_grad(set_to_none=True)
    # Every rank's times: rank 0's wall clock is the job's step; the CPU of all four is what the host spent.
    Path(f"{args.out}.{rank}").write_text(json.dumps({"parallel": args.parallel, "size": args.size, "times": times}))
    rt.finish()


if __name__ == "__main__":
    main()
