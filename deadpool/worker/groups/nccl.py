"""NCCL: the settings a worker runs it with, and how its communicators are built, connected and aborted.

Everything NCCL-specific is here; the rest of the abort-then-rebuild path (which groups held the
lost seat, aborting them together, completing the lost step locally, rebuilding only those groups)
is shared with gloo and the stand-in (``communicators.py``).  A group's communicator is one torch
``ProcessGroup`` with two backends, as torch's ``cpu:gloo,cuda:nccl``: gloo for CPU tensors (the
snapshots' bookkeeping, a script's CPU collectives) and NCCL for CUDA tensors, so that FSDP2, DTensor
and pipelining find both behind the same registered group.

Why the settings (``env_settings``): a collective whose peer died never returns on NCCL, and torch's
watchdog would kill the process over it (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, its heartbeat monitor,
rethrown CUDA errors) before DeadPool aborts the communicator and swaps the seat; communicators are
non-blocking (``config.blocking = 0``) so that neither building nor aborting one can hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# At least this long beyond the collective timeout before torch's heartbeat monitor may act: DeadPool
# aborts a stuck communicator within its own bounds, well before.
WATCHDOG_MARGIN_S = 60.0


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable a worker sets for NCCL, and why."""

    name: str
    value: str
    why: str


def env_settings(environ: Mapping[str, str], collective_timeout: float) -> tuple[list[Setting], list[str]]:
    """What a worker on NCCL sets in its environment (before torch reads it), and warnings about the user's own.

    A value the user set is kept (they may know better), but one that lets torch's watchdog end the
    process over a collective DeadPool would repair is named in a warning.
    """
    wanted = [
        Setting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0",
                "torch's watchdog must not tear the process down over a failed collective: DeadPool aborts the "
                "communicator and swaps the seat (torch's _abort_process_group asks for 0)"),
        Setting("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0",
                "a CUDA error raised by the watchdog's thread would end the process"),
        Setting("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(int(collective_timeout + WATCHDOG_MARGIN_S)),
                "the heartbeat monitor kills a process whose watchdog is stuck: above the collective timeout"),
        Setting("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(collective_timeout)),
                "non-blocking communicators: init and abort return within this bound"),
        Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", "no flight-recorder dump on the timeouts DeadPool repairs"),
    ]
    settings: list[Setting] = []
    warnings: list[str] = []
    for setting in wanted:
        mine = environ.get(setting.name)
        if mine is None:
            settings.append(setting)
        elif mine != setting.value and setting.name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                        "TORCH_NCCL_RETHROW_CUDA_ERRORS"):
            warnings.append(f"{setting.name}={mine} is kept as set, but DeadPool wants {setting.value}: "
                            f"{setting.why}")
    return settings, warnings


def abort_order(names: list[str]) -> list[str]:
    """The order aborts are started in: every communicator of a batch at once (pytorch#150690: aborts of
    several communicators must not run one after another), started in name order on every seat."""
    return sorted(names)


def device_of(local_rank: int) -> torch.device:
    """This worker's CUDA device: LOCAL_RANK modulo the devices it sees (several ranks may share one GPU)."""
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def create(store: Any, prefix: str, rank: int, size: int, timeout: float, gloo: Any,
           device: torch.device) -> Any:
    """One group's communicator: a torch ProcessGroup with `gloo` (built already) for CPU tensors and a fresh,
    non-blocking, eagerly connected NCCL communicator for CUDA tensors, both under `prefix`.

    Raises:
        RuntimeError: NCCL could not build or connect the communicator (a peer died meanwhile).
    """
    from torch._C._distributed_c10d import PrefixStore, ProcessGroup
    from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]  # absent from CPU builds

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timedelta(seconds=timeout)
    options.config.blocking = 0
    nccl = ProcessGroupNCCL(PrefixStore(f"{prefix}/nccl", store), rank, size, options)
    group = ProcessGroup(PrefixStore(prefix, store), rank, size)
    group._set_default_backend(ProcessGroup.BackendType.NCCL)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
    nccl.eager_connect_single_device(device)  # the first step after a swap does not pay for the connect
    return group


def abort(group: Any) -> None:
    """Abort the NCCL communicator of `group` (its gloo part cannot abort; it is left to time out)."""
    group._get_backend(torch.device("cuda")).abort()
