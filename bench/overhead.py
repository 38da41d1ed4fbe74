"""Overhead benchmark: what does protecting a training run cost per step, failure-free?

One run of this command prints one table.  Every row trains the same model
(demos/gpt.py, the demo's batch 8 x block 64, AdamW, LambdaLR, one intra-op
thread per worker) with the same world size (4 ranks, gloo on 127.0.0.1), and
reports the median step time over many steps after a warm-up, as a ratio to
plain ``DistributedDataParallel`` of the same model size measured in the same
run:

- ``plain DDP``: torch DDP, no checkpoint (the baseline, ratio 1.00);
- ``deadpool snapshot every step``: DeadPool, in-memory snapshot after every
  step, held by the buddy (the default; on one host the buddy maps the ward's
  shared-memory slot instead of receiving it);
- ``deadpool snapshot every step, buddy over TCP``: the same with
  ``--shm-dir ""``: every snapshot streamed to the buddy over ZeroMQ, as
  between hosts;
- ``deadpool snapshot every step, replica checks of all`` and ``... off``:
  the same with ``--replica-checks 1`` (all of the replicated state
  checksummed every step, on the snapshot copy thread, where the default
  sums half) and ``--replica-checks 0`` (no checksum);
- ``deadpool snapshot every step, --audit (1 spare)``: the default with a
  spare that re-does one seat's step after another (``--audit``); the ranks'
  CPU counts the audited seats' digests, not the spare's re-done steps,
  which on a host with fewer cores than processes also slow the ranks;
- ``deadpool (snapshots off)``: DeadPool with ``--snapshot-every`` larger than
  the run, so no snapshot is taken.  DeadPool's ``rt.ddp`` is not torch DDP
  (buckets with a layout that never changes, for bit-identical replay, waited on
  interruptibly, plus the runtime thread), so this row separates the cost of
  that path from the cost of snapshots;
- ``torch.save every step``: rank 0 ``torch.save``s model, optimizer,
  scheduler and RNG state every step, blocking;
- ``dcp.save every step``: ``torch.distributed.checkpoint.save`` on every rank;
- ``dcp.async_save every step``: ``torch.distributed.checkpoint.async_save``,
  each save first waiting for the previous one's future.

Size ``llama`` is the sharded rows: the Llama demo's model (demos/llama.py, 13.2M parameters,
batch 4 x block 64) under torch's own FSDP2 (4-way) and FSDP2 x tensor parallel (2x2) on a mesh
from ``init_device_mesh`` (``plain FSDP2``, ``plain FSDP2+TP``), and the same on
``rt.device_mesh`` with a snapshot every step (``deadpool FSDP2 ...``, ``deadpool FSDP2+TP
...``); each ratio is to the plain row of the same parallelism.  Separate launches differ by
up to 10% on this host; ``bench/overhead_injob.py`` measures the same pairs inside one job,
with confidence intervals.

Columns: ``step_s_median`` (rank 0's wall time from one step's start to the
next one's, so work done between steps counts), ``ratio`` (to plain DDP of the
same size), ``stall_p99_s`` (p99 over the measured steps of the time the loop
was blocked by the protection: DeadPool's optimizer pre-step wait; the save
call for torch.save/dcp.save; the wait for the previous future plus the
``async_save`` call for dcp.async_save), ``snapshot_bytes`` (one snapshot or
checkpoint of the training state: DeadPool's per-seat arena, the torch.save
file, the DCP directory).

Usage::

    python bench/overhead.py               # all sizes; about 10-12 minutes on 2 cores
    python bench/overhead.py --quick       # small model only, fewer steps
    python bench/overhead.py --json        # the rows as a JSON list instead of the table
    python bench/overhead.py --json docs/results/overhead.json   # a results file: date, machine, commit, rows

Every worker process is bounded by a timeout and its whole process group is
killed afterwards.  The machine may be shared: each row also records the
fraction of the CPUs that processes other than this benchmark's used while it
ran (``foreign_cpu``), so a disturbed row can be recognised.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "overhead_worker.py"
WORLD = 4


@dataclass(frozen=True)
class System:
    """One row kind: a display name, the worker mode, and DeadPool's snapshot cadence (if DeadPool)."""

    key: str  # for --systems
    name: str
    mode: str
    snapshot_every: int | None = None
    launch_args: tuple[str, ...] = ()  # extra `deadpool launch` arguments
    shard: str = "none"  # the worker's --shard (deadpool on rt.device_mesh)
    baseline: str = "ddp"  # the key of the row its ratio is to
    sizes: tuple[str, ...] = ("small", "large")  # the sizes it runs at


GPT_SIZES = ("small", "large")
SHARDED = ("llama",)  # the Llama demo's model, sharded
SYSTEMS = (
    System("ddp", "plain DDP", "ddp"),
    System("deadpool", "deadpool snapshot every step", "deadpool", 1),
    System("deadpool_tcp", "deadpool snapshot every step, buddy over TCP", "deadpool", 1, ("--shm-dir", "")),
    System("deadpool_checks1", "deadpool snapshot every step, replica checks of all", "deadpool", 1,
           ("--replica-checks", "1")),
    System("deadpool_nochecks", "deadpool snapshot every step, replica checks off", "deadpool", 1,
           ("--replica-checks", "0")),
    System("deadpool_audit", "deadpool snapshot every step, --audit (1 spare)", "deadpool", 1,
           ("--spares", "1", "--audit")),
    System("deadpool_off", "deadpool (snapshots off)", "deadpool", 1_000_000),
    System("torch_save", "torch.save every step", "torch_save"),
    System("dcp_save", "dcp.save every step", "dcp_save"),
    System("dcp_async_save", "dcp.async_save every step", "dcp_async_save"),
    System("fsdp", "plain FSDP2", "fsdp", baseline="fsdp", sizes=SHARDED),
    System("deadpool_fsdp", "deadpool FSDP2 snapshot every step", "deadpool", 1, shard="fsdp", baseline="fsdp",
           sizes=SHARDED),
    System("fsdp_tp", "plain FSDP2+TP", "fsdp_tp", baseline="fsdp_tp", sizes=SHARDED),
    System("deadpool_fsdp_tp", "deadpool FSDP2+TP snapshot every step", "deadpool", 1, shard="fsdp_tp",
           baseline="fsdp_tp", sizes=SHARDED),
)

# (measured steps, warmup steps, per-step bound in seconds for the timeout) by size
# The large model's step is about 3.5-4 s with 4 ranks on 2 cores: 8 measured steps keep the whole
# default run near 10 minutes there.  Its warm-up is 4 steps because DeadPool's first snapshots
# (577 MB per seat) fault in fresh arena and buddy memory and stall 1-2 s; steady state starts after.
DEFAULT_STEPS = {"small": (60, 10, 3.0), "large": (8, 4, 30.0), "llama": (30, 5, 8.0)}
QUICK_STEPS = {"small": (20, 5, 3.0), "large": (4, 3, 30.0), "llama": (8, 3, 8.0)}
STARTUP_BOUND_S = 120.0  # imports, rendezvous and process-group setup of 4 workers on a busy 2-core host


@dataclass
class Row:
    """One line of the table (and one object of --json)."""

    system: str
    size: str
    params: int
    step_s_median: float
    ratio: float
    stall_p99_s: float
    snapshot_bytes: int
    mode: str = ""
    steps: int = 0
    body_s_median: float = 0.0
    boundary_s_median: float = 0.0  # between one step body's end and the next one's start (DeadPool's capture)
    stall_median_s: float = 0.0
    final_loss: float = 0.0
    cpu_s_per_step: float = 0.0
    cpu_ratio: float = 0.0
    foreign_cpu: float = 0.0
    wall_s: float = 0.0
    runs: list[float] = field(default_factory=list)  # step_s_median of each round
    round_ratios: list[float] = field(default_factory=list)  # each round's median over the baseline's, same round
    threads_cpu_s_per_step: dict[str, float] = field(default_factory=dict)  # all ranks, by thread name
    baseline: str = ""  # the row its ratios are to
    device: str = "cpu"  # where the model trained (rank 0's device)
    gpu: str = ""  # the GPU's name on a --device cuda run


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_env(**extra: str) -> dict[str, str]:
    """One intra-op thread, gloo on loopback, repo importable: the demo's worker environment."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    })
    env.pop("DEADPOOL_SNAPSHOT_EVERY", None)  # the launcher's flag sets it per row
    env.pop("DEADPOOL_SHM_DIR", None)  # likewise: the default (shared memory on one host) unless a row says
    env.update(extra)
    return env


def _busy_jiffies() -> int | None:
    """CPU time (all CPUs, clock ticks) the whole machine spent busy so far; None where /proc is absent."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq + steal


def _machine_busy(interval_s: float) -> float | None:
    """Fraction of all CPUs busy over the next `interval_s` (None without /proc)."""
    before = _busy_jiffies()
    time.sleep(interval_s)
    after = _busy_jiffies()
    if before is None or after is None:
        return None
    return (after - before) / os.sysconf("SC_CLK_TCK") / (interval_s * (os.cpu_count() or 1))


def wait_for_quiet(max_wait_s: float, threshold: float = 0.15) -> float:
    """Wait (at most `max_wait_s`) until other processes leave the CPUs mostly idle; returns seconds waited.

    Between rows nothing of this benchmark runs, so whatever keeps the CPUs busy belongs to someone
    else, and a row started then measures the contention, not the system.  Bounded: on a host
    that never quiets down the row runs anyway and its foreign_cpu column says so.
    """
    began = time.monotonic()
    while time.monotonic() - began < max_wait_s:
        busy = _machine_busy(1.0)
        if busy is None or busy < threshold:
            break
    return time.monotonic() - began


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kill_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to what is left of one process group this benchmark started.

    Called after every run, not only on timeout: a launcher that exits early could leave a
    coordinator or worker behind, and a leftover process would load the next row's measurement.
    """
    deadline = time.monotonic() + grace_s
    sig: signal.Signals | int = 0
    for sig in (0, signal.SIGTERM):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _run_group(commands: list[tuple[list[str], dict[str, str]]], log: Path, timeout_s: float) -> int:
    """Start `commands` in one new process group, wait for all within `timeout_s`, always clean up.

    Returns the first non-zero exit status, 124 on timeout (as timeout(1) does).
    """
    procs: list[subprocess.Popen[bytes]] = []
    status = 0
    with log.open("ab") as out:
        try:
            for command, env in commands:
                procs.append(subprocess.Popen(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                    process_group=procs[0].pid if procs else 0,  # one new group (in our session) for all
                ))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return 124
                status = status or code
            return status
        finally:
            if procs:
                _kill_group(procs[0].pid)
                for proc in procs:
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        print(f"warning: pid {proc.pid} survived SIGKILL", file=sys.stderr)


def run_system(system: System, size: str, steps: int, warmup: int, per_step_s: float, work: Path,
               verbose: bool, quiet_wait_s: float = 0.0, device: str = "cpu") -> tuple[dict[str, Any], float, float]:
    """One row's run: returns rank 0's result, the wall seconds, and the foreign CPU fraction.

    Raises:
        RuntimeError: the run failed or timed out (the log file is named).
    """
    run_dir = Path(tempfile.mkdtemp(prefix=f"{system.mode}-{size}-", dir=work))
    out = run_dir / "result.json"
    log = run_dir / "log.txt"
    worker_args = [str(WORKER), "--mode", system.mode, "--size", "small" if size in SHARDED else size,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", str(out),
                   "--ckpt-dir", str(run_dir / "ckpt"), "--device", device, "--shard", system.shard]
    if size in SHARDED:
        worker_args += ["--batch", "4"]
    if system.mode == "deadpool":
        launch = [sys.executable, "-m", "deadpool", "launch", "--nproc", str(WORLD), "--spares", "0",
                  "--events", str(run_dir / "events.jsonl"), "--snapshot-every", str(system.snapshot_every),
                  *system.launch_args]
        commands = [(launch + worker_args, _child_env())]
    else:
        port = str(free_port())
        commands = [
            ([sys.executable, *worker_args],
             _child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(WORLD)
        ]
    timeout_s = STARTUP_BOUND_S + (steps + warmup + 1) * per_step_s
    if quiet_wait_s > 0:
        wait_for_quiet(quiet_wait_s)
    busy0, cpu0, began = _busy_jiffies(), _children_cpu_s(), time.monotonic()
    status = _run_group(commands, log, timeout_s)
    wall = time.monotonic() - began
    busy1, cpu1 = _busy_jiffies(), _children_cpu_s()
    foreign = 0.0
    if busy0 is not None and busy1 is not None:
        machine_s = (busy1 - busy0) / os.sysconf("SC_CLK_TCK")
        foreign = max(0.0, machine_s - (cpu1 - cpu0)) / (wall * (os.cpu_count() or 1))
    if verbose:
        print(f"  {system.name:32s} {size:5s} exit {status} in {wall:6.1f}s (foreign cpu {foreign:.0%})",
              file=sys.stderr, flush=True)
    if status != 0 or not out.exists():
        reason = "timed out" if status == 124 else f"exit status {status}"
        raise RuntimeError(f"{system.name} ({size}) failed: {reason}; log kept at {log}")
    result = json.loads(out.read_text())
    per_rank = [json.loads(f.read_text()) for f in sorted(run_dir.glob("result.json.cpu*"))]
    result["cpu_s_per_step"] = sum(r["cpu_s_per_step"] for r in per_rank) if len(per_rank) == WORLD else 0.0
    threads: dict[str, float] = {}
    for record in per_rank:
        for name, value in record.get("threads_cpu_s_per_step", {}).items():
            threads[name] = threads.get(name, 0.0) + value
    result["threads_cpu_s_per_step"] = {k: round(v, 5) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])}
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return result, wall, foreign


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def measure(systems: list[System], sizes: list[str], table: dict[str, tuple[int, int, float]], repeat: int,
            verbose: bool, work: Path, quiet_wait_s: float = 0.0, device: str = "cpu") -> list[Row]:
    """Every system at every size, `repeat` rounds each (median of the per-round medians)."""
    rows: list[Row] = []
    for size in sizes:
        steps, warmup, per_step = table[size]
        systems_here = [s for s in systems if size in s.sizes]
        if not systems_here:
            continue
        collected: dict[str, list[tuple[dict[str, Any], float, float]]] = {s.name: [] for s in systems_here}
        for _ in range(repeat):
            for system in systems_here:  # interleaved rounds: slow drifts of a shared host hit every row alike
                collected[system.name].append(run_system(system, size, steps, warmup, per_step, work, verbose,
                                                         quiet_wait_s, device))
        size_rows = []
        for system in systems_here:
            runs = collected[system.name]
            medians = [statistics.median(r["step_s"][warmup:]) for r, _, _ in runs]
            stalls = [s for r, _, _ in runs for s in r.get("stall_s", [])]
            first = runs[0][0]
            size_rows.append(Row(
                system=system.name, size=size, params=int(first["params"]),
                step_s_median=statistics.median(medians), ratio=0.0, stall_p99_s=_p99(stalls),
                snapshot_bytes=int(first.get("snapshot_bytes", 0)), mode=system.mode, steps=steps,
                body_s_median=statistics.median(statistics.median(r["body_s"][warmup:]) for r, _, _ in runs),
                boundary_s_median=statistics.median(
                    statistics.median(p - b for p, b in zip(r["step_s"][warmup:], r["body_s"][warmup:]))
                    for r, _, _ in runs),
                stall_median_s=statistics.median(stalls) if stalls else 0.0,
                final_loss=float(first["loss"][-1]) if first["loss"] else 0.0,
                cpu_s_per_step=statistics.median(r["cpu_s_per_step"] for r, _, _ in runs),
                foreign_cpu=max(f for _, _, f in runs),
                threads_cpu_s_per_step=first.get("threads_cpu_s_per_step", {}),
                wall_s=sum(w for _, w, _ in runs), runs=medians,
                device=str(first.get("device", device)), gpu=str(first.get("gpu", "")),
            ))
        # Each ratio is to the plain row of the same parallelism; a run without it (--systems) compares to the
        # size's first row.
        names = {s.key: s.name for s in SYSTEMS}
        for system, row in zip(systems_here, size_rows, strict=True):
            base_row = next((r for r in size_rows if r.system == names[system.baseline]), size_rows[0])
            row.baseline = base_row.system
            row.ratio = row.step_s_median / base_row.step_s_median if base_row.step_s_median > 0 else float("nan")
            row.round_ratios = [round(mine / base, 4) for mine, base in zip(row.runs, base_row.runs, strict=True)]
            base_cpu = base_row.cpu_s_per_step
            row.cpu_ratio = row.cpu_s_per_step / base_cpu if base_cpu > 0 else float("nan")
        rows.extend(size_rows)
    return rows


def _human_bytes(n: int) -> str:
    if n <= 0:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def render(rows: list[Row], elapsed: float, repeat: int) -> str:
    """The table and the notes that say how to read it."""
    import torch

    width = max([31, *(len(row.system) for row in rows)])
    head = f"{'system':{width}s} {'size':5s} {'params':>7s} {'step_s_median':>13s} {'ratio':>6s} " \
           f"{'stall_p99_s':>11s} {'snapshot_bytes':>14s} {'cpu_s_step':>10s} {'cpu_ratio':>9s} {'foreign_cpu':>11s}" \
           f" {'round_ratios':>13s}"
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{row.system:{width}s} {row.size:5s} {row.params / 1e6:6.1f}M {row.step_s_median:13.4f} {row.ratio:6.3f} "
            f"{row.stall_p99_s:11.4f} {_human_bytes(row.snapshot_bytes):>14s} {row.cpu_s_per_step:10.4f} "
            f"{row.cpu_ratio:9.3f} {row.foreign_cpu:11.0%} {_spread(row.round_ratios):>13s}"
        )
    steps = ", ".join(f"{size}: {rows_of[0].steps} measured steps" for size, rows_of in _by_size(rows).items())
    gpus = sorted({row.gpu for row in rows if row.gpu})
    if gpus:
        gpu = f"on the GPU ({', '.join(gpus)}): all {WORLD} ranks share it, gloo carries the all-reduce of CUDA " \
              "tensors through host memory, DeadPool copies snapshots on a side stream into pinned memory"
    else:
        gpu = f"no GPU in this run: CPU only, {WORLD} ranks on gloo over 127.0.0.1; DeadPool's GPU path (side " \
              "stream into pinned memory) was not measured"
    lines += [
        "",
        f"Notes: {WORLD} ranks, {os.cpu_count()} CPUs, torch {torch.__version__}, one intra-op thread per rank; "
        f"{gpu}.",
        f"  {steps}; medians after warm-up, {repeat} round(s); whole benchmark {elapsed:.0f} s.",
        "  step_s_median: rank 0, start of a step to start of the next (includes work between steps).",
        "  ratio: to plain DDP of the same size in this run, the llama rows to the plain row of their parallelism",
        "    (to the size's first row when --systems leaves the baseline out).",
        "  stall_p99_s: time the loop was blocked by the protection (DeadPool: optimizer pre-step wait for the",
        "    snapshot copy and the buddy's ack; torch.save/dcp.save: the save call; dcp.async_save: waiting for",
        "    the previous save plus the async_save call); with under 100 steps the p99 is the maximum.",
        "  snapshot_bytes: one snapshot of the state (DeadPool: per-seat arena; every seat holds its own and",
        "    a copy of its ward's; torch.save: the file; DCP: the checkpoint directory).",
        "  deadpool snapshot every step: on one host each buddy maps its ward's shared-memory slot (no copy);",
        "    ', buddy over TCP' (--shm-dir \"\") streams every snapshot over ZeroMQ instead, as between hosts.",
        "  deadpool (snapshots off): DeadPool's rt.ddp is not torch DDP (fixed buckets for bit-identical",
        "    replay, waited on interruptibly).",
        "    The snapshot cost is 'snapshot every step' relative to this row; the difference between this row",
        "    and plain DDP is the all-reduce path and the runtime thread, not snapshots.",
        "  cpu_s_step: CPU seconds per measured step summed over the 4 ranks (all their threads: copy, runtime,",
        "    gloo, ZeroMQ; not the launcher or coordinator); cpu_ratio: the same to plain DDP.  Less sensitive",
        "    than wall time to other load on the host: on a host with fewer cores than ranks, step time follows it.",
        "  foreign_cpu: share of the machine's CPUs used by other processes during the row (shared host);",
        "    rows above a few percent were disturbed.",
        "  round_ratios: with --repeat, the lowest and highest ratio of one round (each round's median over",
        "    the baseline's median of the same round): how far one run's ratio can move on this host.",
    ]
    return "\n".join(lines)


def _spread(ratios: list[float]) -> str:
    """'lowest-highest' of the per-round ratios; '-' for a single round."""
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else "-"


def _by_size(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(row.size, []).append(row)
    return out


def _raise_on_terminate() -> None:
    """Turn SIGTERM into an exception, so an interrupted benchmark still kills the workers it started."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import results
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,large,llama",
                        help="comma-separated model sizes (small: 3.3M GPT, large: 48M GPT, llama: the sharded rows)")
    parser.add_argument("--quick", action="store_true", help="small model only, fewer steps (smoke check)")
    parser.add_argument("--steps", type=int, default=0, help="override the measured steps of every size")
    parser.add_argument("--warmup", type=int, default=-1, help="override the warm-up steps of every size")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every row (interleaved); medians of rounds")
    parser.add_argument("--systems", default=",".join(s.key for s in SYSTEMS),
                        help="comma-separated rows to run (default: all): " + ", ".join(s.key for s in SYSTEMS))
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each row, wait up to this many seconds for other processes to leave the "
                             "CPUs idle (a shared host); 0: never wait")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every row trains (cuda: one GPU per LOCAL_RANK %% GPU count; gloo all-reduce)")
    results.json_option(parser, "the rows (a list of objects)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, results, events)")
    args = parser.parse_args(argv)
    sizes = ["small"] if args.quick else [s.strip() for s in args.sizes.split(",") if s.strip()]
    for size in sizes:
        if size not in DEFAULT_STEPS:
            parser.error(f"unknown size {size!r}; choose from {', '.join(DEFAULT_STEPS)}")
    by_key = {s.key: s for s in SYSTEMS}
    wanted = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in by_key]
    if unknown or not wanted:
        parser.error(f"unknown --systems {unknown}; choose from {', '.join(by_key)}")
    systems = [s for s in SYSTEMS if s.key in wanted]  # table order, whatever the order given
    table = dict(QUICK_STEPS if args.quick else DEFAULT_STEPS)
    for size, (steps, warmup, per_step) in list(table.items()):
        table[size] = (args.steps or steps, warmup if args.warmup < 0 else args.warmup, per_step)
    _raise_on_terminate()
    work = Path(tempfile.mkdtemp(prefix="deadpool-overhead-"))
    began = time.monotonic()
    try:
        rows = measure(systems, sizes, table, max(1, args.repeat), verbose=not args.json, work=work,
                       quiet_wait_s=args.quiet_wait, device=args.device)
    except RuntimeError as err:
        print(f"overhead benchmark failed: {err} (work directory {work} kept)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"overhead benchmark interrupted; its workers were stopped (work directory {work} kept)",
              file=sys.stderr)
        return 130
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - began
    if args.json and args.json != "-":
        results.write(args.json, "overhead", [asdict(r) for r in rows], elapsed_s=round(elapsed, 1),
                      repeat=max(1, args.repeat), device=args.device,
                      steps={size: list(table[size][:2]) for size in sizes})
    if args.json == "-":
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(render(rows, elapsed, max(1, args.repeat)))
        if args.keep:
            print(f"  work directory kept: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
