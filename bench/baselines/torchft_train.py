"""TorchFT baseline worker: one replica group of one process, fault tolerant through torchft.

TorchFT (PyPI ``torchft``) keeps training going when a replica group dies: the
survivors' next quorum (from the lighthouse) leaves it out, the failed step is
not committed and is retried, and a restarted group heals by fetching the live
state from a peer over HTTP.  This script is the same model, data and
hyper-parameters as the restart baseline and DeadPool's demo, with 4 replica
groups of one process each: replica ``i`` trains on ``get_batch(.., step, i, ..)``.

Everything is kept on 127.0.0.1.  TorchFT 0.2.0 binds its manager server to
``[::]:port`` (hard-coded in ``Manager.__init__``) and its checkpoint HTTP server
to ``("", 0)`` on IPv6, i.e. every interface; ``loopback_torchft()`` below
rebinds both to 127.0.0.1 and advertises 127.0.0.1.  The replica group's own
TCPStore is hosted here on a loopback-only socket, and the lighthouse is
started by the driver with ``--bind 127.0.0.1:PORT``.

Gradients: ``--grad-sync ddp`` (default) uses ``torchft.DistributedDataParallel``
(a DDP whose comm hook calls ``manager.allreduce``); ``--grad-sync allreduce``
averages one flat gradient through ``manager.allreduce`` by hand.

Steps are ``manager.current_step()``: the number of committed steps.  A replica
group SIGKILLs itself at the start of ``--kill-step`` if it is ``--kill-replica``
and the marker file does not exist yet (so its restarted process trains on).
"""

from __future__ import annotations

import os

# Before the slow imports (see restart_train.py): lets the driver clean up by pid.
if os.environ.get("BASELINE_PIDFILE"):
    with open(os.environ["BASELINE_PIDFILE"], "a") as _pidfile:
        _pidfile.write(f"{os.getpid()}\n")

import argparse
import json
import random
import signal
import socket
import sys
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.baselines.restart_train import state_digest
from bench.baselines.torchrun_loopback import create_store
from demos.gpt import build_model, get_batch, load_corpus, lr_lambda

LOOPBACK = "127.0.0.1"


class Events:
    """JSON lines on a shared O_APPEND file; ``rank`` is the replica group id."""

    def __init__(self, path: str | None, replica: int) -> None:
        self.replica = replica
        self.launch = int(os.environ.get("BASELINE_LAUNCH", "0"))
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1

    def emit(self, event: str, step: int = -1, **fields: Any) -> None:
        record = {
            "ts": round(time.time(), 6),
            "event": event,
            "rank": self.replica,
            "step": step,
            "pid": os.getpid(),
            "launch": self.launch,
            **fields,
        }
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._fd >= 0:
            os.write(self._fd, line)
        else:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


class _LoopbackHTTPServer(ThreadingHTTPServer):
    """torchft's checkpoint server, but on 127.0.0.1 (IPv4) instead of every interface."""

    address_family = socket.AF_INET
    request_queue_size = 1024
    daemon_threads = True

    def __init__(self, server_address: tuple[str, int], handler: Any) -> None:
        super().__init__((LOOPBACK, server_address[1]), handler)


def loopback_torchft() -> type:
    """Rebind torchft's servers to loopback; returns the checkpoint transport class to use."""
    import torchft.checkpointing.http_transport as http_transport  # type: ignore[import-untyped]
    import torchft.manager as manager_mod  # type: ignore[import-untyped]

    http_transport._IPv6HTTPServer = _LoopbackHTTPServer
    original_server = manager_mod.ManagerServer

    def manager_server(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[1]
        kwargs["bind"] = f"{LOOPBACK}:{port}"
        kwargs["hostname"] = LOOPBACK
        return original_server(**kwargs)

    manager_mod.ManagerServer = manager_server

    class LoopbackHTTPTransport(http_transport.HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{LOOPBACK}:{port}/checkpoint/"

    return LoopbackHTTPTransport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, required=True, help="replica group id (0..n-1)")
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-replica", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--marker-dir", required=True)
    parser.add_argument("--events", default=None)
    parser.add_argument("--grad-sync", choices=["ddp", "allreduce"], default="ddp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--start-barrier",
        type=int,
        default=0,
        help="first launch only: wait until this many replicas have a manager before step 0",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="torchft collective/rpc timeout, seconds")
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    return parser.parse_args(argv)


def start_barrier(directory: Path, replica: int, count: int, timeout_s: float) -> None:
    """Wait (bounded) until ``count`` replicas have created their manager.

    Why: the lighthouse forms the first quorum from whoever asks first; a replica
    whose imports took 0.3 s longer then joins at step 1 by healing, and the
    failure-free reference would not have 4 replicas in every step.
    """
    (directory / f"ready-{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(directory.glob("ready-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(directory.glob('ready-*')))} of {count} replicas ready")
        time.sleep(0.02)


def average_gradients(manager: Any, params: list[torch.nn.Parameter]) -> None:
    """One flat allreduce (AVG over the participants) through the manager; errors are
    recorded by the manager and make ``should_commit`` return False."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p)
        offset += n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    events = Events(args.events, args.replica)
    events.emit("worker_started")
    transport_cls = loopback_torchft()
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo  # type: ignore[import-untyped, unused-ignore]

    # The replica group's TCPStore (world 1), hosted here, loopback only.
    store = create_store(LOOPBACK, 0, world_size=1, is_master=True, timeout=timedelta(seconds=args.timeout))
    corpus = load_corpus()
    model = build_model(args.size, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup=10, total=args.steps))
    torch.manual_seed(args.seed * 1000 + args.replica)
    random.seed(args.seed * 1000 + args.replica)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        events.emit("healed", step=int(sched.last_epoch))

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=LOOPBACK,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname=LOOPBACK,
        checkpoint_transport=transport_cls(timeout=timeout, num_chunks=0),
        init_sync=False,  # every replica builds identical weights from the seed
    )
    net = DistributedDataParallel(manager, model) if args.grad_sync == "ddp" else model
    params = [p for p in model.parameters() if p.requires_grad]
    events.emit("manager_ready", step=manager.current_step(), store_port=store.port)

    if args.start_barrier > 0 and events.launch == 0:
        start_barrier(Path(args.marker_dir), args.replica, args.start_barrier, args.quorum_timeout)
        events.emit("barrier_passed")

    marker = Path(args.marker_dir) / f"killed-{args.kill_replica}.marker"
    while manager.current_step() < args.steps:
        step = manager.current_step()
        if args.replica == args.kill_replica and step == args.kill_step and not marker.exists():
            marker.write_text(f"{os.getpid()} {time.time()}\n")
            events.emit("killing", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.time()
        manager.start_quorum()
        opt.zero_grad(set_to_none=True)
        inputs, targets = get_batch(corpus, step, args.replica, args.batch, args.block, args.seed)
        _, loss = net(inputs, targets)
        loss.backward()
        if args.grad_sync == "allreduce":
            average_gradients(manager, params)
        if manager.should_commit():
            opt.step()
            sched.step()
            events.emit(
                "step_finished",
                step=step,
                loss=round(loss.item(), 5),
                participants=manager.num_participants(),
                s=round(time.time() - began, 4),
            )
        else:
            events.emit("step_failed", step=step, participants=manager.num_participants())

    events.emit("training_finished", step=manager.current_step() - 1, state_digest=state_digest(model, opt))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
