"""Can N NCCL ranks share one GPU here?  A standalone torch.distributed probe, no DeadPool.

``bench/gpu_check.py`` starts it as N processes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set, and ``NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MAX_CTAS=2``),
all on GPU 0.  NCCL before 2.30 refuses two ranks on one device ("Duplicate GPU detected");
2.30 and later allow it with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (experimental).  Each rank
creates the process group eagerly, all-reduces a CUDA tensor twice (the first one pays for
the connections), checks the sum, and prints one line ``PROBE {json}``; exit status 0 only
when every step worked.

    python bench/nccl_probe.py --info      # one line INFO {json}: torch, CUDA, NCCL, the GPUs

By hand, two ranks::

    for r in 0 1; do NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MAX_CTAS=2 RANK=$r WORLD_SIZE=2 \\
        MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python bench/nccl_probe.py & done; wait
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

import torch


def nccl_version() -> str:
    """The NCCL that torch loaded (``LD_PRELOAD`` can put another first), as "2.30.4"; "" without one."""
    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except (AttributeError, RuntimeError):
        return ""
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def info() -> dict[str, Any]:
    """What this process's torch sees: versions and the GPUs (no CUDA context made without a GPU)."""
    record: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda or "",
                              "cuda_available": torch.cuda.is_available(), "nccl": ""}
    if not record["cuda_available"]:
        return record
    record["nccl"] = nccl_version()
    record["device_count"] = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    record["gpu"] = props.name
    record["gpu_memory_gib"] = round(props.total_memory / 2**30, 2)
    record["capability"] = f"{props.major}.{props.minor}"
    record["nccl_available"] = torch.distributed.is_nccl_available()
    return record


def probe(timeout_s: float, numel: int) -> dict[str, Any]:
    """One rank of the probe; raises whatever NCCL raises (the caller prints it)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0)  # every rank on the same GPU: the point of the probe
    torch.cuda.set_device(device)
    began = time.perf_counter()
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=timeout_s))  # device_id: the communicator now
    init_s = time.perf_counter() - began
    times = []
    for _ in range(2):
        tensor = torch.full((numel,), float(rank + 1), device=device)
        began = time.perf_counter()
        dist.all_reduce(tensor)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
        expected = world * (world + 1) / 2
        if not torch.all(tensor == expected).item():
            raise RuntimeError(f"all_reduce gave {tensor[0].item()} (and maybe more), expected {expected}")
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "nccl": nccl_version(), "init_s": round(init_s, 4),
            "first_allreduce_s": round(times[0], 4), "allreduce_s": round(times[1], 4), "numel": numel}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--info", action="store_true", help="print versions and GPUs, then exit")
    parser.add_argument("--timeout", type=float, default=60.0, help="the process group's collective timeout (s)")
    parser.add_argument("--numel", type=int, default=1 << 20, help="float32 elements all-reduced")
    args = parser.parse_args()
    if args.info:
        print("INFO " + json.dumps(info()), flush=True)
        return 0
    print("PROBE " + json.dumps(probe(args.timeout, args.numel)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
