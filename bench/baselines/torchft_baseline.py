"""Driver for the TorchFT baseline: a lighthouse and N one-process replica groups.

When the victim replica SIGKILLs itself, the survivors' allreduce fails, that
step is not committed, the lighthouse drops the victim from the next quorum
(after ``heartbeat_timeout_ms``) and the survivors go on with N-1 replicas.  The
driver, playing the scheduler that TorchFT expects, starts a new process for the
dead replica group at once; it joins a later quorum and heals from a peer.

Returned keys (seconds, from the workers' wall-clock events):
``recovery_s`` kill -> the interrupted step committed (by the survivors);
``rejoin_s`` kill -> first step the restarted replica committed (all N again);
``heal_s`` kill -> the restarted replica loaded the state from a peer;
``steps_recomputed`` 0 (TorchFT never rolls back; the failed step is retried);
``failed_step_attempts`` uncommitted step attempts; ``degraded_steps`` committed
steps with fewer than N participants (their update averages N-1 batches, so the
result is not the failure-free one); ``total_s``, ``median_step_s``,
``mean_step_s``; ``state_digest`` of the final state (one value if all replicas
agree); ``non_loopback_listeners`` sockets of ours found listening off loopback
(should be empty).

Usage::

    from bench.baselines.torchft_baseline import run_torchft_baseline
    run_torchft_baseline(40, kill_replica=2, kill_step=20, workdir="/tmp/tft")
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
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
)

TRAIN = REPO / "bench" / "baselines" / "torchft_train.py"


def lighthouse_command() -> list[str]:
    """torchft's lighthouse (a Rust binary inside the wheel, exposed as a console script).

    ``lighthouse_main`` parses the process's own argv after the interpreter, so it
    must be run through its console script, not ``python -c``.
    """
    script = Path(sys.executable).parent / "torchft_lighthouse"
    if not script.exists():
        found = shutil.which("torchft_lighthouse")
        if found is None:
            raise FileNotFoundError("torchft_lighthouse not found: pip install torchft")
        return [found]
    return [sys.executable, str(script)]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(REPO),
        )


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGTERM the process's session, SIGKILL it after ``grace_s``; always reaps."""
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _non_loopback_listeners(pids: set[int]) -> list[str]:
    """Listening TCP sockets of ``pids`` bound anywhere but 127.0.0.1 (from ``ss``)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["ss unavailable"]
    found = []
    for line in out.splitlines():
        if not any(f"pid={pid}," in line for pid in pids):
            continue
        local = line.split()[3]
        if not local.startswith("127.0.0.1:"):
            found.append(line.strip())
    return found


def summarize_torchft(
    events: list[dict[str, Any]], replicas: int, kill_replica: int | None, total_s: float
) -> dict[str, Any]:
    """Numbers from the events; a step's time is when its first committing replica logged it."""
    commits: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in events:
        if record.get("event") == "step_finished":
            commits[int(record["step"])].append(record)
    # The first commit of a step: all participants commit on the same should_commit
    # answer within milliseconds, while a late healer may commit the same step number
    # much later on its own, so the max would mislead.
    steps = sorted((min(float(r["ts"]) for r in rows), step, rows) for step, rows in commits.items())
    result: dict[str, Any] = {"mode": "torchft", "total_s": round(total_s, 3)}
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1]
    if gaps:
        result["median_step_s"] = round(statistics.median(gaps), 4)
        result["mean_step_s"] = round(statistics.fmean(gaps), 4)
    if steps:
        result["train_span_s"] = round(steps[-1][0] - steps[0][0], 3)
    digests = sorted({str(r["state_digest"]) for r in events if r.get("event") == "training_finished"})
    result["state_digest"] = digests[0] if len(digests) == 1 else digests or None
    result["finished_replicas"] = len({r["rank"] for r in events if r.get("event") == "training_finished"})
    kills = [r for r in events if r.get("event") == "killing"]
    if not kills:
        result["degraded_steps"] = sum(
            1 for _, _, rows in steps if min(int(r.get("participants", 0)) for r in rows) < replicas
        )
        return result
    kill_ts, kill_step = float(kills[0]["ts"]), int(kills[0]["step"])
    result["kill_ts"] = kill_ts
    done = [s for s in steps if s[1] >= kill_step]
    result["recovery_s"] = round(done[0][0] - kill_ts, 3) if done else None
    result["resume_step"] = kill_step
    result["steps_recomputed"] = 0
    rejoined = [
        r
        for r in events
        if r.get("event") == "step_finished" and r.get("rank") == kill_replica and int(r.get("launch", 0)) > 0
    ]
    # Rejoined = the restarted replica commits a step together with all the others.
    full = [r for r in rejoined if int(r.get("participants", 0)) >= replicas] or rejoined
    first = min(full, key=lambda r: float(r["ts"])) if full else None
    result["rejoin_s"] = round(float(first["ts"]) - kill_ts, 3) if first else None
    result["rejoin_step"] = int(first["step"]) if first else None
    result["rejoin_participants"] = int(first.get("participants", 0)) if first else None
    healed = [r for r in events if r.get("event") == "healed" and int(r.get("launch", 0)) > 0]
    result["heal_s"] = round(float(healed[0]["ts"]) - kill_ts, 3) if healed else None
    result["failed_step_attempts"] = sum(
        1 for r in events if r.get("event") == "step_failed" and float(r["ts"]) > kill_ts
    )
    result["degraded_steps"] = sum(
        1 for _, _, rows in done if min(int(r.get("participants", 0)) for r in rows) < replicas
    )
    return result


def _wait_listening(port: int, proc: subprocess.Popen[bytes], bound_s: float) -> None:
    """Until something accepts on 127.0.0.1:`port` (or `proc` exits, or the bound passes)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.01)


def run_torchft_baseline(
    steps: int = 40,
    kill_replica: int | None = 2,
    kill_step: int | None = 20,
    workdir: str | Path = "/tmp/deadpool-torchft-baseline",
    replicas: int = 4,
    grad_sync: str = "ddp",
    timeout_s: float = 240.0,
    heartbeat_timeout_ms: int = 1000,
    join_timeout_ms: int = 60000,
    op_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run one TorchFT job (failure-free if ``kill_replica`` is None); return its numbers.

    ``heartbeat_timeout_ms`` is how long the lighthouse keeps a silent replica in
    the quorum (torchft's default is 5000; 1000 here so detection is not the
    bottleneck; managers heartbeat every 100 ms).  ``join_timeout_ms`` is how long
    a quorum waits for live (heartbeating) replicas that have not asked yet; it is
    left at torchft's 60000 because a short one (1000 was tried) drops replicas that
    are merely slow on a loaded machine, which then heal and skew the numbers.  Everything is bounded by
    ``timeout_s`` and every process is stopped on the way out.
    """
    work = Path(workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    events_path, pidfile = work / "events.jsonl", work / "pids"
    lighthouse_port = free_port()
    lighthouse_cmd = [
        *lighthouse_command(),
        f"--bind=127.0.0.1:{lighthouse_port}",
        "--min_replicas=1",
        f"--join_timeout_ms={join_timeout_ms}",
        f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
        "--quorum_tick_ms=20",
    ]
    kill = kill_replica is not None and kill_replica >= 0 and kill_step is not None

    def replica_cmd(replica: int) -> list[str]:
        cmd = [
            sys.executable,
            str(TRAIN),
            f"--replica={replica}",
            f"--lighthouse=http://127.0.0.1:{lighthouse_port}",
            f"--steps={steps}",
            f"--marker-dir={work}",
            f"--events={events_path}",
            f"--grad-sync={grad_sync}",
            f"--start-barrier={replicas}",
            f"--timeout={op_timeout_s}",
        ]
        if kill:
            cmd += [f"--kill-replica={kill_replica}", f"--kill-step={kill_step}"]
        return cmd

    load_before = load_average()
    meter = CpuMeter()
    began = time.monotonic()
    deadline = began + timeout_s
    lighthouse = _start(lighthouse_cmd, child_env(RUST_LOG="warn"), work / "lighthouse.log")
    procs: dict[int, subprocess.Popen[bytes]] = {}
    every: list[subprocess.Popen[bytes]] = [lighthouse]
    restarts: dict[int, int] = defaultdict(int)
    status = "running"
    listeners: list[str] | None = None
    try:
        _wait_listening(lighthouse_port, lighthouse, bound_s=10.0)  # as a launcher waits for its coordinator
        for replica in range(replicas):
            env = child_env(BASELINE_PIDFILE=str(pidfile), BASELINE_LAUNCH="0", RUST_LOG="warn")
            procs[replica] = _start(replica_cmd(replica), env, work / f"replica{replica}.log")
            every.append(procs[replica])
        while status == "running":
            if time.monotonic() > deadline:
                status = "timeout"
                break
            if lighthouse.poll() is not None:
                status = f"lighthouse exited {lighthouse.returncode}"
                break
            if listeners is None and time.monotonic() - began > 15:
                listeners = _non_loopback_listeners({p.pid for p in every} | set(read_pids(pidfile)))
            for replica, proc in list(procs.items()):
                code = proc.poll()
                if code is None or code == 0:
                    continue
                if kill and replica == kill_replica and code == -signal.SIGKILL and restarts[replica] == 0:
                    # The scheduler's part: a new process for the dead replica group.
                    restarts[replica] += 1
                    env = child_env(
                        BASELINE_PIDFILE=str(pidfile), BASELINE_LAUNCH=str(restarts[replica]), RUST_LOG="warn"
                    )
                    procs[replica] = _start(replica_cmd(replica), env, work / f"replica{replica}.log")
                    every.append(procs[replica])
                else:
                    status = f"replica {replica} exited {code}"
            if status == "running" and all(p.poll() == 0 for p in procs.values()):
                status = "ok"
            time.sleep(0.05)
    finally:
        for proc in every:
            _stop(proc)
        stray = kill_pids(read_pids(pidfile), marker=str(TRAIN))
    total_s = time.monotonic() - began

    result = summarize_torchft(read_events(events_path), replicas, kill_replica if kill else None, total_s)
    result.update(
        {
            "status": status,
            "ok": status == "ok" and result.get("finished_replicas") == replicas,
            "replicas": replicas,
            "world": replicas,
            "steps": steps,
            "kill_replica": kill_replica if kill else None,
            "kill_step": kill_step if kill else None,
            "grad_sync": grad_sync,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "restarted_processes": sum(restarts.values()),
            "stray_workers_killed": len(stray),
            "non_loopback_listeners": listeners,
            "load_avg_before": load_before,
            **meter.stop(),
            "load_avg_after": load_average(),
            "events": str(events_path),
            "workdir": str(work),
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TorchFT baseline (lighthouse + one-process replica groups)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-replica", type=int, default=2, help="-1: failure-free")
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--grad-sync", choices=["ddp", "allreduce"], default="ddp")
    parser.add_argument("--workdir", default="/tmp/deadpool-torchft-baseline")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    args = parser.parse_args(argv)
    result = run_torchft_baseline(
        args.steps,
        None if args.kill_replica < 0 else args.kill_replica,
        args.kill_step,
        args.workdir,
        replicas=args.replicas,
        grad_sync=args.grad_sync,
        timeout_s=args.timeout,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
