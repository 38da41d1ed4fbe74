"""Driver for the restart baseline: one DDP job, one SIGKILLed rank, recovery from disk.

Two ways to recover, both measured the same way from the workers' events:

* ``mode="torchrun"`` (reported as ``'torchrun --max-restarts'``): torchrun's agent
  sees the dead worker, stops the others, and starts all W again from the newest
  checkpoint.  This works once the workers namespace their store keys per attempt
  (see ``restart_train.init_distributed``); with torch's default keys the
  restarted gloo group fails ("Connection refused") or hangs.
* ``mode="relaunch"`` (``'full relaunch'``): torchrun with ``--max-restarts 0``
  exits when a worker dies and the driver starts a brand-new torchrun, as a user
  or a scheduler requeue would.

Returned keys (times in seconds, from wall-clock ``ts`` of the events):
``recovery_s`` kill -> first step finished by all ranks after the restart;
``catchup_s`` kill -> the interrupted step finished (recomputation included);
``steps_recomputed`` finished steps that were lost and redone; ``total_s`` the
driver's wall time for the whole job (process starts included);
``median_step_s``/``mean_step_s`` per-step time (the mean includes checkpoint
writes); ``state_digest`` SHA-256 of the final model+optimizer state (equal for a
run with and without the failure when the resume is exact).

Usage from Python::

    from bench.baselines.restart_baseline import run_restart_baseline
    run_restart_baseline(40, kill_rank=2, kill_step=20, ckpt_every=10, world=4, workdir="/tmp/rb")

or ``python -m bench.baselines.restart_baseline --steps 40 --kill-rank 2 --kill-step 20``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.baselines._common import (
    REPO,
    CpuMeter,
    child_env,
    free_port,
    kill_pids,
    load_average,
    read_events,
    read_pids,
    run_bounded,
    summarize,
)

TRAIN = REPO / "bench" / "baselines" / "restart_train.py"
TORCHRUN = REPO / "bench" / "baselines" / "torchrun_loopback.py"
MODES = {"torchrun": "torchrun --max-restarts", "relaunch": "full relaunch"}


def torchrun_command(
    world: int, port: int, max_restarts: int, train_args: list[str], loopback_shim: bool = True
) -> list[str]:
    """The torchrun command line (through the loopback shim unless told otherwise)."""
    launcher = [sys.executable, str(TORCHRUN)] if loopback_shim else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *launcher,
        f"--nproc-per-node={world}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(TRAIN),
        *train_args,
    ]


def _driver_event(path: Path, event: str, launch: int, **fields: Any) -> None:
    """The driver's own events (rank -1) in the workers' file: when each torchrun ran."""
    record = {"ts": round(time.time(), 6), "event": event, "rank": -1, "step": -1, "launch": launch, **fields}
    with path.open("a") as handle:
        handle.write(json.dumps(record, separators=(",", ":")) + "\n")


def run_restart_baseline(
    steps: int = 40,
    kill_rank: int | None = 2,
    kill_step: int | None = 20,
    ckpt_every: int = 10,
    world: int = 4,
    workdir: str | Path = "/tmp/deadpool-restart-baseline",
    mode: str = "torchrun",
    timeout_s: float = 240.0,
    max_relaunches: int = 2,
    pg_timeout_s: float = 60.0,
    attempt_prefix: bool = True,
    ddp_warmup_on_resume: bool = False,
) -> dict[str, Any]:
    """Run one job (failure-free if ``kill_rank`` is None) and return its numbers.

    ``workdir`` is emptied first; it keeps the checkpoints, ``events.jsonl`` and
    ``torchrun.log`` for inspection.  Every child is bounded by ``timeout_s`` for
    the whole job and killed (session, then stray workers by pid) on the way out.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
    work = Path(workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    events_path, log_path, pidfile = work / "events.jsonl", work / "torchrun.log", work / "pids"
    train_args = [
        f"--steps={steps}",
        f"--ckpt-every={ckpt_every}",
        f"--ckpt-dir={work / 'ckpt'}",
        f"--events={events_path}",
        f"--pg-timeout={pg_timeout_s}",
    ]
    if kill_rank is not None and kill_rank >= 0 and kill_step is not None:
        train_args += [f"--kill-rank={kill_rank}", f"--kill-step={kill_step}"]
    if not attempt_prefix:
        train_args.append("--no-attempt-prefix")
    if ddp_warmup_on_resume:
        train_args.append("--ddp-warmup-on-resume")

    load_before = load_average()
    meter = CpuMeter()
    began = time.monotonic()
    deadline = began + timeout_s
    codes: list[int] = []
    try:
        launches = 1 if mode == "torchrun" else 1 + max_relaunches
        for launch in range(launches):
            left = deadline - time.monotonic()
            if left <= 1:
                codes.append(124)
                break
            env = child_env(BASELINE_PIDFILE=str(pidfile), BASELINE_LAUNCH=str(launch))
            cmd = torchrun_command(world, free_port(), 1 if mode == "torchrun" else 0, train_args)
            _driver_event(events_path, "torchrun_started", launch=launch)
            code, _ = run_bounded(cmd, env, log_path, left)
            _driver_event(events_path, "torchrun_exited", launch=launch, returncode=code)
            codes.append(code)
            if code == 0 or code == 124:
                break
    finally:
        stray = kill_pids(read_pids(pidfile), marker=str(TRAIN))
    total_s = time.monotonic() - began

    result = summarize(read_events(events_path), world, MODES[mode], total_s)
    result.update(
        {
            "returncodes": codes,
            "ok": bool(codes) and codes[-1] == 0 and result.get("finished", False),
            "launches": len(codes),
            "steps": steps,
            "world": world,
            "ckpt_every": ckpt_every,
            "ddp_warmup_on_resume": ddp_warmup_on_resume,
            "kill_rank": kill_rank,
            "kill_step": kill_step,
            "stray_workers_killed": len(stray),
            "load_avg_before": load_before,
            **meter.stop(),
            "load_avg_after": load_average(),
            "events": str(events_path),
            "log": str(log_path),
        }
    )
    saves = [r for r in read_events(events_path) if r.get("event") == "checkpoint_saved"]
    if saves:
        result["ckpt_save_s_mean"] = round(sum(float(r["s"]) for r in saves) / len(saves), 4)
        result["ckpt_bytes"] = int(saves[0]["bytes"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="restart baseline (torchrun restart or full relaunch)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-rank", type=int, default=2, help="-1: failure-free")
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mode", choices=sorted(MODES), default="torchrun")
    parser.add_argument("--workdir", default="/tmp/deadpool-restart-baseline")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--no-attempt-prefix", action="store_true", help="reproduce the failed torchrun restart")
    parser.add_argument("--ddp-warmup-on-resume", action="store_true", help="bit-identical resume (see restart_train)")
    args = parser.parse_args(argv)
    result = run_restart_baseline(
        args.steps,
        None if args.kill_rank < 0 else args.kill_rank,
        args.kill_step,
        args.ckpt_every,
        args.world,
        args.workdir,
        mode=args.mode,
        timeout_s=args.timeout,
        attempt_prefix=not args.no_attempt_prefix,
        ddp_warmup_on_resume=args.ddp_warmup_on_resume,
    )
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
