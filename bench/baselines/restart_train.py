"""Restart baseline worker: plain DDP training with disk checkpoints, run under torchrun.

This is what a team without hot-swap does: checkpoint to disk every K steps, and
when a rank dies let the launcher (``torchrun --max-restarts``) or a person
relaunch the whole job, which resumes from the newest checkpoint.  It is the
baseline DeadPool's hot-swap is measured against (bench/recovery.py), so it uses
the shared demo model and exactly the same hyper-parameters.

Step numbering: ``step`` runs ``0 .. steps-1`` like ``range(steps)``.  A
checkpoint is written after step ``s`` when ``(s + 1) % ckpt_every == 0`` (so
it holds ``s + 1`` finished steps) and the job resumes at ``s + 1``.  The kill
(``--kill-rank R --kill-step S``) fires at the start of step S on rank R,
before its forward pass: steps ``0 .. S-1`` are finished, step S is not.  It
fires only once per checkpoint directory (a marker file), so the restarted
attempt trains through.

Events are JSON lines (``ts``, ``event``, ``rank``, ``step`` + own fields),
appended with one ``write`` on an ``O_APPEND`` descriptor so the four ranks can
share one file: ``worker_started``, ``resumed``, ``step_finished``,
``checkpoint_saved``, ``killing``, ``training_finished``.
"""

from __future__ import annotations

import os

# Before the slow imports: let a driver find (and, if it must, kill) every worker
# it caused, since torchrun starts each worker in a session of its own.
if os.environ.get("BASELINE_PIDFILE"):
    with open(os.environ["BASELINE_PIDFILE"], "a") as _pidfile:
        _pidfile.write(f"{os.getpid()}\n")

import argparse
import hashlib
import json
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# The shared demo model lives in demos/ at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.baselines.torchrun_loopback import create_store
from demos.gpt import build_model, get_batch, load_corpus, lr_lambda

CKPT_PREFIX = "ckpt-"
KILL_MARKER = "killed.marker"


class Events:
    """JSON-lines writer shared by every process of a job (one write per line, O_APPEND)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.launch = int(os.environ.get("BASELINE_LAUNCH", "0"))  # set by a relaunching driver
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1

    def emit(self, event: str, step: int = -1, **fields: Any) -> None:
        record = {
            "ts": round(time.time(), 6),
            "event": event,
            "rank": self.rank,
            "step": step,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "launch": self.launch,
            **fields,
        }
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._fd >= 0:
            os.write(self._fd, line)
        else:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=10, help="K: checkpoint every K steps (0: never)")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--keep-ckpts", type=int, default=2, help="how many newest checkpoints to keep (0: all)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--events", default=None, help="JSON-lines file (default: stdout)")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-attempt-prefix",
        action="store_true",
        help="use torch's default store keys (reproduces the failed reconnect after a torchrun restart)",
    )
    parser.add_argument(
        "--ddp-warmup-on-resume",
        action="store_true",
        help="after a resume, run one throw-away forward/backward so DDP rebuilds its buckets "
        "before the first real step: makes the resumed run bit-identical to an uninterrupted one",
    )
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    return parser.parse_args(argv)


def init_distributed(rank: int, world: int, timeout: timedelta, attempt_prefix: bool) -> None:
    """Create the gloo group so that it also works in a torchrun-restarted attempt.

    Under torchrun the workers use the agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE),
    and the agent keeps that store across restarts.  ``init_process_group("gloo")``
    puts each rank's listening address under fixed keys
    (``default_pg/0//cpu//0/<rank>``), so a restarted rank can read a key left by
    the dead attempt before the new peer overwrites it, and gloo's connectFullMesh
    then dials a closed port ("Connection refused"), or, depending on which rank
    starts first, the group blocks until its timeout.  Namespacing the keys by
    TORCHELASTIC_RESTART_COUNT gives every attempt a clean key space; this is the
    fix (``--no-attempt-prefix`` reproduces the failure).

    Without the agent store (plain env launch, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    under the c10d rendezvous), rank 0 hosts a fresh store each attempt, bound
    to 127.0.0.1 only.
    """
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    store: Any
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        if attempt_prefix:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt-{attempt}", store)  # type: ignore[attr-defined]
        else:
            store = dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]  # what env:// does
    else:
        store = create_store(addr, port, world_size=world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """Checkpoint files are named by finished steps, zero-padded, so the max name is the newest."""
    files = sorted(ckpt_dir.glob(f"{CKPT_PREFIX}*.pt"))
    return files[-1] if files else None


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(
    ckpt_dir: Path,
    done: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    world: int,
    keep: int = 2,
) -> tuple[Path | None, int]:
    """Write the checkpoint for ``done`` finished steps; returns (path, bytes) on rank 0.

    Model, optimizer and scheduler are replicated under DDP, so rank 0 writes them.
    RNG states differ per rank (dropout), so every rank's is gathered to rank 0 and
    stored too: a resumed run then draws the same dropout masks as an uninterrupted
    one.  Written to a temp file then renamed, so a crash mid-write never leaves a
    truncated file that the next attempt would load.
    """
    states: list[Any] = [None] * world
    dist.all_gather_object(states, rng_state())
    if rank != 0:
        return None, 0
    path = ckpt_dir / f"{CKPT_PREFIX}{done:08d}.pt"
    tmp = ckpt_dir / f".{path.name}.{os.getpid()}.tmp"
    payload = {
        "done": done,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": states,
        "world": world,
    }
    with tmp.open("wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    size = path.stat().st_size
    # Keep the newest few, as users do (K=1 over 40 steps would otherwise leave 1.6 GB).
    for old in sorted(ckpt_dir.glob(f"{CKPT_PREFIX}*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path, size


def ddp_warmup(
    ddp: DDP, opt: torch.optim.Optimizer, corpus: torch.Tensor, step: int, rank: int, args: argparse.Namespace
) -> None:
    """One forward/backward whose gradients are thrown away, RNG untouched.

    Why: a new DDP wrapper reduces its first backward with the initial bucket
    layout (reverse parameter order) and only then rebuilds buckets in gradient-
    ready order.  Gloo's allreduce rounds differently for a different layout, so
    the first real step after a resume would differ in the last bits from the
    uninterrupted run, and the final state would not be bit-identical.  Spending
    the initial-layout iteration on a throw-away batch avoids that.
    """
    saved = rng_state()
    inputs, targets = get_batch(corpus, step, rank, args.batch, args.block, args.seed)
    _, loss = ddp(inputs, targets)
    loss.backward()
    opt.zero_grad(set_to_none=True)
    set_rng_state(saved)


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over parameters and optimizer tensors: equal digests mean equal final states."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    for index, state in sorted(opt.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    events = Events(args.events, rank)
    events.emit(
        "worker_started",
        world=world,
        master_port=os.environ.get("MASTER_PORT"),
        restart_count=os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    )
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    # A bounded timeout: a lost peer must end this process, not hang it for 30 minutes.
    init_distributed(rank, world, timedelta(seconds=args.pg_timeout), attempt_prefix=not args.no_attempt_prefix)
    events.emit("pg_ready")

    corpus = load_corpus()
    model = build_model(args.size, seed=args.seed)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup=10, total=args.steps))
    torch.manual_seed(args.seed * 1000 + rank)  # per-rank dropout stream
    random.seed(args.seed * 1000 + rank)

    start = 0
    latest = newest_checkpoint(ckpt_dir)
    if latest is not None:
        loaded_at = time.time()
        payload = torch.load(latest, weights_only=False)
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        sched.load_state_dict(payload["scheduler"])
        if payload.get("world") == world:
            set_rng_state(payload["rng"][rank])
        start = int(payload["done"])
        if args.ddp_warmup_on_resume:
            ddp_warmup(ddp, opt, corpus, start, rank, args)
        events.emit("resumed", step=start, path=str(latest), load_s=round(time.time() - loaded_at, 4))
    else:
        events.emit("fresh_start", step=0)

    marker = ckpt_dir / KILL_MARKER
    for step in range(start, args.steps):
        if rank == args.kill_rank and step == args.kill_step and not marker.exists():
            marker.write_text(f"{os.getpid()} {time.time()}\n")
            events.emit("killing", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = get_batch(corpus, step, rank, args.batch, args.block, args.seed)
        _, loss = ddp(inputs, targets)
        loss.backward()  # DDP averages the gradients across ranks here
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        events.emit("step_finished", step=step, loss=round(loss.item(), 5))
        if args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0:
            began = time.time()
            _path, size = save_checkpoint(ckpt_dir, step + 1, model, opt, sched, rank, world, args.keep_ckpts)
            if rank == 0:
                events.emit("checkpoint_saved", step=step, done=step + 1, bytes=size, s=round(time.time() - began, 4))

    digest = state_digest(model, opt)
    events.emit("training_finished", step=args.steps - 1, state_digest=digest)
    if rank == 0:
        print(f"final state digest: {digest}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
