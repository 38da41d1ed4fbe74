"""What ``deadpool launch`` refuses before anything starts: arguments that are wrong or that can never work.

Each refusal is a ``MisuseError`` naming the fix (the launcher exits 2 with it); what may still work
but probably will not (a chaos spec's step beyond the script's ``--steps``) is a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deadpool.agent import coordinators
from deadpool.chaos import ChaosSpec, unreachable
from deadpool.chaos import parse as parse_chaos
from deadpool.config import Backend, is_loopback
from deadpool.errors import MisuseError


def validate(args: argparse.Namespace) -> None:
    """Refuse bad arguments with a clear message before anything starts.

    Raises:
        MisuseError: what is wrong and how to fix it.
    """
    if args.nproc < 0 or args.spares < 0:
        raise MisuseError(f"--nproc and --spares must be >= 0, got {args.nproc} and {args.spares}")
    if args.nproc == 0 and not (args.spares > 0 and args.coordinator):
        raise MisuseError("--nproc 0 only adds spares to a running job: give --spares N and --coordinator ADDR")
    if args.nproc + args.spares == 0:
        raise MisuseError("nothing to start: --nproc and --spares are both 0")
    bind = args.bind_host or args.master_addr or "127.0.0.1"
    if not is_loopback(bind) and not os.environ.get("DEADPOOL_SECRET"):
        raise MisuseError(
            f"refusing to listen on {bind} (not loopback) without a shared secret: set DEADPOOL_SECRET to the same "
            "value on every host, so that no one else on the network can join, fence or stop the job"
        )
    if args.nnodes < 1:
        raise MisuseError(f"--nnodes must be at least 1, got {args.nnodes}")
    if getattr(args, "audit", False) and args.spares == 0 and args.nnodes == 1:
        raise MisuseError("--audit needs a spare to re-do the seats' steps: give --spares 1 or more")
    if not 0 <= args.node_rank < args.nnodes:
        raise MisuseError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if not 0 <= args.coordinator_port <= 65535 or not 0 <= args.master_port <= 65535:
        raise MisuseError(f"ports must be in 0..65535, got --coordinator-port {args.coordinator_port} and "
                          f"--master-port {args.master_port}")
    if not -1 <= getattr(args, "metrics_port", -1) <= 65535:
        raise MisuseError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if getattr(args, "standby_coordinator", False) and (args.nnodes < coordinators.MIN_STANDBY_HOSTS
                                                        or getattr(args, "no_standby", False)):
        raise MisuseError(f"--standby-coordinator needs --nnodes {coordinators.MIN_STANDBY_HOSTS} or more (and no "
                          "--no-standby): a takeover needs a majority of the hosts to confirm that the active "
                          "coordinator is lost, and with 2 hosts neither can tell a cut from the other's loss")
    if args.node_rank > 0 and not args.coordinator:
        raise MisuseError("hosts other than --node-rank 0 need --coordinator tcp://HOST:PORT of host 0's coordinator")
    shm_dir = getattr(args, "shm_dir", None)
    if shm_dir and not Path(shm_dir).is_dir():
        raise MisuseError(f"--shm-dir {shm_dir!r} is not a directory (give \"\" to send buddy copies over TCP)")
    if not Path(args.script).is_file():
        raise MisuseError(f"training script {args.script!r} does not exist")
    if args.events and (Path(args.events).is_dir() or not Path(args.events).parent.is_dir()):
        raise MisuseError(f"--events {args.events!r} must name a file in a folder that exists")
    if getattr(args, "backend", Backend.AUTO) == Backend.NCCL:
        why = nccl_missing()
        if why:
            raise MisuseError(f"--backend nccl: {why} on this machine (use --backend gloo, or auto)")
    if getattr(args, "resume", False) and not args.checkpoint_dir:
        raise MisuseError("--resume needs --checkpoint-dir DIR: the folder of the disk checkpoints to continue from")
    refusals, warnings = check_launch(args.nnodes * args.nproc if args.nproc else None, args.spares,
                                      [parse_chaos(spec) for spec in args.chaos], args.script_args,
                                      args.checkpoint_every, args.nnodes)
    if refusals:
        raise MisuseError("; ".join(refusals))
    for warning in warnings:
        print(f"deadpool launch: warning: {warning}", file=sys.stderr, flush=True)


def nccl_missing() -> str:
    """Why NCCL cannot carry this machine's tensors ("" where it can): no CUDA device, or a torch without NCCL.
    Imports torch (only for ``--backend nccl``)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return ""


def visible_steps(script_args: list[str]) -> int | None:
    """The script's step count if its arguments show it (``--steps N`` or ``--steps=N``), else None."""
    found = None
    for i, arg in enumerate(script_args):
        value = script_args[i + 1] if arg == "--steps" and i + 1 < len(script_args) else None
        if arg.startswith("--steps="):
            value = arg.partition("=")[2]
        if value is not None and value.isdigit():
            found = int(value)  # the last one wins, as with argparse
    return found


def check_launch(world: int | None, spares: int, specs: list[ChaosSpec], script_args: list[str],
                 checkpoint_every: int, hosts: int | None = None) -> tuple[list[str], list[str]]:
    """What a launch can never do as asked: (refusals, warnings), each a sentence naming the fix.

    `world` is nnodes x nproc (None for a launch that only adds spares to a running job), `hosts` nnodes.
    A world of one with spares and no disk checkpoint is refused: its one seat is its own
    buddy, so its snapshot dies with it and a spare could never restore anything.
    """
    refusals: list[str] = []
    warnings: list[str] = []
    if world == 1 and spares > 0 and checkpoint_every <= 0:
        refusals.append(
            f"--spares {spares} with a world of one seat and no disk checkpoint: the seat's in-memory snapshot "
            "has no buddy on another process and dies with it, so a spare could never restore anything. "
            "Use --nproc 2 or more, add --checkpoint-dir DIR --checkpoint-every N, or drop --spares")
    steps = visible_steps(script_args)
    for spec in specs:
        refusal, warning = unreachable(spec, world, spares, steps, hosts)
        if refusal:
            refusals.append(refusal)
        if warning:
            warnings.append(warning)
    return refusals, warnings
