"""Shared pieces of the baseline drivers: ports, bounded child processes, event summaries.

The drivers start process trees they must always take down again (a baseline
that leaves four trainers running ruins the next measurement), and they turn
the workers' JSON-line events into the same numbers for every baseline, so
bench/recovery.py can put them side by side with DeadPool's.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the usual bind-to-0 probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """Environment for workers: one intra-op thread, gloo on loopback, repo importable."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        }
    )
    env.update(extra)
    return env


def _is_our_worker(pid: int, marker: str) -> bool:
    """True if ``pid`` is alive and its command line contains ``marker`` (guards PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def read_pids(pidfile: Path) -> list[int]:
    if not pidfile.exists():
        return []
    return [int(line) for line in pidfile.read_text().split() if line.strip().isdigit()]


def kill_pids(pids: Iterable[int], marker: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, every listed pid still running ``marker``."""
    alive = [pid for pid in pids if _is_our_worker(pid, marker)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_is_our_worker(p, marker) for p in alive):
        time.sleep(0.05)
    for pid in alive:
        if _is_our_worker(pid, marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return alive


def run_bounded(cmd: Sequence[str], env: dict[str, str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` in its own session with output to ``log_path``; returns (returncode, wall_s).

    On timeout the whole session gets SIGTERM, then SIGKILL, and the return code is
    124 (as timeout(1) reports it), so a hung job is a result, not a hung benchmark.
    """
    began = time.monotonic()
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(REPO),
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = 124
            _kill_session(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_session(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                _kill_session(proc, signal.SIGKILL)
                proc.wait(timeout=10)
    return code, time.monotonic() - began


def _kill_session(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def read_events(path: Path) -> list[dict[str, Any]]:
    """Events of a file in order; lines that do not parse (a torn last line) are skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def step_times(events: list[dict[str, Any]], world: int) -> list[tuple[float, int, int]]:
    """(ts, step, incarnation) when every rank finished a step, in time order.

    ``incarnation`` is ``launch * 1000 + attempt``: a fresh torchrun (full relaunch)
    bumps ``launch``, a torchrun restart bumps ``attempt``.

    A step counts as finished when the last rank reports it: that is when the job
    (not one process) has it.  ``incarnation`` separates an attempt's steps from
    the recomputed ones of a later attempt.
    """
    finished: dict[tuple[int, int], list[float]] = defaultdict(list)
    for record in events:
        if record.get("event") == "step_finished":
            incarnation = int(record.get("launch", 0)) * 1000 + int(record.get("attempt", 0))
            finished[(incarnation, int(record["step"]))].append(float(record["ts"]))
    rows = [(max(ts), step, inc) for (inc, step), ts in finished.items() if len(ts) >= world]
    return sorted(rows)


def summarize(events: list[dict[str, Any]], world: int, mode: str, total_s: float) -> dict[str, Any]:
    """The numbers every baseline reports (see the module docstring of each driver)."""
    steps = step_times(events, world)
    result: dict[str, Any] = {"mode": mode, "total_s": round(total_s, 3)}
    if steps:
        result["train_span_s"] = round(steps[-1][0] - steps[0][0], 3)
        result["first_step_ts"] = steps[0][0]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps) if b[2] == a[2] and b[1] == a[1] + 1]
    if gaps:
        result["median_step_s"] = round(statistics.median(gaps), 4)
        result["mean_step_s"] = round(statistics.fmean(gaps), 4)
    digests = {r.get("state_digest") for r in events if r.get("event") == "training_finished"}
    digests.discard(None)
    result["state_digest"] = digests.pop() if len(digests) == 1 else (sorted(digests) if digests else None)
    result["finished"] = bool(digests) or bool(result["state_digest"])
    kills = [r for r in events if r.get("event") == "killing"]
    if not kills:
        return result
    kill_ts = float(kills[0]["ts"])
    kill_step = int(kills[0]["step"])
    result["kill_ts"] = kill_ts
    killed_in = int(kills[0].get("launch", 0)) * 1000 + int(kills[0].get("attempt", 0))
    # Split by incarnation, not by time: a survivor may log the step before the kill
    # a few ms after the victim died.
    before = [s for s in steps if s[2] <= killed_in]
    after = [s for s in steps if s[2] > killed_in]
    last_before = max((s[1] for s in before), default=-1)
    result["last_step_before_kill"] = last_before
    if after:
        first = after[0]
        result["recovery_s"] = round(first[0] - kill_ts, 3)
        result["resume_step"] = first[1]
        result["steps_recomputed"] = max(0, last_before + 1 - first[1])
        caught_up = [s for s in after if s[1] >= kill_step]
        if caught_up:
            # kill -> the step that was interrupted is finished: time to get back to
            # where the job was, recomputation included.
            result["catchup_s"] = round(caught_up[0][0] - kill_ts, 3)
    else:
        result["recovery_s"] = None
        result["steps_recomputed"] = None
    # Where the recovery time goes: when the last rank of the next incarnation
    # reached each point, relative to the kill.
    phases: dict[str, float] = {}
    back_at = after[0][0] if after else float("inf")
    for record in events:
        if record.get("event") in ("torchrun_exited", "torchrun_started") and kill_ts < float(record["ts"]) < back_at:
            phases.setdefault(str(record["event"]), round(float(record["ts"]) - kill_ts, 3))
    for name in ("worker_started", "pg_ready", "resumed"):
        stamps = [
            float(r["ts"])
            for r in events
            if r.get("event") == name and int(r.get("launch", 0)) * 1000 + int(r.get("attempt", 0)) > killed_in
        ]
        if stamps:
            phases[name] = round(max(stamps) - kill_ts, 3)
    result["recovery_phases_s"] = phases
    return result


def load_average() -> float:
    """1-minute load average: recorded with each measurement because the machine is shared."""
    return round(os.getloadavg()[0], 2)


def _busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (all cores, /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """How much of the machine other people's processes used during a measurement.

    Why: this 2-core machine is shared with other sessions, and a baseline that
    ran beside someone's test suite is slower for reasons of its own.  The share
    is (machine busy CPU - CPU of our reaped children) / (wall * cores); call
    ``stop`` after every child has been waited for.
    """

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._busy = _busy_seconds()
        self._ours = _children_cpu_seconds()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._wall
        busy = _busy_seconds() - self._busy
        ours = _children_cpu_seconds() - self._ours
        cores = os.cpu_count() or 1
        return {
            "cpu_ours_s": round(ours, 2),
            "cpu_foreign_share": round(max(0.0, busy - ours) / max(wall * cores, 1e-9), 3),
        }


def wait_for_quiet(max_wait_s: float = 120.0, busy_share: float = 0.25, sample_s: float = 2.0) -> float:
    """Wait (bounded) until the machine is mostly idle; returns the last busy share seen.

    Used before a measurement so other sessions' work distorts it less; never
    blocks longer than ``max_wait_s``.
    """
    deadline = time.monotonic() + max_wait_s
    cores = os.cpu_count() or 1
    while True:
        before = _busy_seconds()
        time.sleep(sample_s)
        share = (_busy_seconds() - before) / (sample_s * cores)
        if share <= busy_share or time.monotonic() >= deadline:
            return round(share, 3)
