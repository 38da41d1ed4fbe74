"""Overhead inside one job: DeadPool's path against torch's own, alternating blocks of steps, with 95% CIs.

Separate launches of identical code differ by up to 10% on this host, so a 2% overhead cannot be
shown by comparing them.  Here one ``deadpool launch --nproc 4 --spares 0`` per parallelism runs
``bench/injob_worker.py``, which trains the same model on the same data twice in one process set:
on torch's own groups (``plain``) and on DeadPool's (``deadpool``: snapshot every step;
``nosnap``: DeadPool's path with snapshots off), alternating blocks of steps.  Each round gives
one ratio per pair (the medians of the two blocks, the first step of each block left out: it
carries the switch); the table shows the geometric mean over rounds with its 95% confidence
interval (Student t over the rounds' log ratios), of rank 0's wall time and of the CPU seconds
all four ranks spent per step (every thread, the snapshot copy thread too).

Rows, per parallelism (``ddp``: the GPT demo's model on ``rt.ddp`` against torch DDP; ``fsdp``:
the Llama demo's under FSDP2 4-way; ``fsdp-tp``: FSDP2 x TP on a 2x2 mesh):

- ``deadpool ... snapshot every step`` over ``plain ...``: what protection costs in all;
- ``deadpool ... snapshots off`` over ``plain ...``: DeadPool's collectives path alone;
- ``snapshot every step`` over ``snapshots off``: the snapshots alone.

    python bench/overhead_injob.py                  # all three; about 15 minutes on 2 cores
    python bench/overhead_injob.py --quick          # fewer rounds
    python bench/overhead_injob.py --parallel fsdp-tp --rounds 20 --json
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "injob_worker.py"
NAMES = {"ddp": ("plain DDP", "deadpool rt.ddp"), "fsdp": ("plain FSDP2", "deadpool FSDP2"),
         "fsdp-tp": ("plain FSDP2+TP", "deadpool FSDP2+TP")}
MODELS = {"ddp": "GPT small (3.3M)", "fsdp": "Llama small (13.2M)", "fsdp-tp": "Llama small (13.2M)"}
# Two-sided 95% Student t quantiles by degrees of freedom (normal beyond the table).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00}


@dataclass
class Row:
    parallel: str
    model: str
    system: str
    baseline: str
    ratio: float  # wall time, rank 0
    ci_low: float
    ci_high: float
    cpu_ratio: float  # CPU seconds of all ranks
    cpu_ci_low: float
    cpu_ci_high: float
    rounds: int
    step_s_median: float
    baseline_step_s_median: float


def t95(df: int) -> float:
    known = [d for d in sorted(T95) if d <= df]
    return T95[known[-1]] if known else T95[1] if df >= 1 else math.inf


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of `ratios` and its 95% interval (t over the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def block_medians(times: list[list[Any]]) -> dict[tuple[str, int], float]:
    """Median step time of every block, without its first step (which pays the switch of mode)."""
    blocks: dict[tuple[str, int], list[float]] = {}
    for mode, block, seconds in times:
        blocks.setdefault((mode, int(block)), []).append(float(seconds))
    return {key: statistics.median(values[1:] or values) for key, values in blocks.items()}


def pair_ratios(medians: dict[tuple[str, int], float], top: str, bottom: str, modes: int = 3) -> list[float]:
    """Per round, `top`'s block median over `bottom`'s (blocks of round r are r*modes .. r*modes+modes-1)."""
    by_round: dict[int, dict[str, float]] = {}
    for (mode, block), median in medians.items():
        by_round.setdefault(block // modes, {})[mode] = median
    return [r[top] / r[bottom] for _, r in sorted(by_round.items()) if top in r and bottom in r and r[bottom] > 0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(parallel: str, rounds: int, block_steps: int, work: Path, nproc: int = 4) -> dict[str, Any]:
    """One job of `nproc` ranks; returns rank 0's wall times and, per step, the CPU seconds of all ranks together."""
    out = work / f"{parallel}.json"
    command = [sys.executable, "-m", "deadpool", "launch", "--no-progress", "--events", str(work / f"{parallel}.jsonl"),
               "--nproc", str(nproc), "--spares", "0", str(WORKER), "--parallel", parallel, "--rounds", str(rounds),
               "--block-steps", str(block_steps), "--port", str(free_port()), "--out", str(out)]
    print(f"{parallel}: {rounds} rounds of 3 blocks of {block_steps} steps ...", file=sys.stderr, flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    ranks = [work / f"{parallel}.json.{rank}" for rank in range(nproc)]
    if proc.returncode != 0 or not all(path.exists() for path in ranks):
        raise SystemExit(f"{parallel}: the job failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    per_rank = [json.loads(path.read_text())["times"] for path in ranks]
    wall = [[mode, block, seconds] for mode, block, seconds, _ in per_rank[0]]
    cpu = [[mode, block, sum(r[i][3] for r in per_rank)] for i, (mode, block, _, _) in enumerate(per_rank[0])]
    return {"times": wall, "cpu": cpu}


def rows_of(parallel: str, data: dict[str, Any]) -> list[Row]:
    medians, cpu = block_medians(data["times"]), block_medians(data["cpu"])
    plain, mine = NAMES[parallel]

    def mode_median(mode: str) -> float:
        return statistics.median(v for (m, _), v in medians.items() if m == mode)

    rows = []
    for top, bottom, system, baseline in (
        ("deadpool", "plain", f"{mine} snapshot every step", plain),
        ("nosnap", "plain", f"{mine} snapshots off", plain),
        ("deadpool", "nosnap", f"{mine} snapshot every step", f"{mine} snapshots off"),
    ):
        ratios = pair_ratios(medians, top, bottom)
        ratio, low, high = ratio_ci(ratios)
        cpu_ratio, cpu_low, cpu_high = ratio_ci(pair_ratios(cpu, top, bottom))
        rows.append(Row(parallel, MODELS[parallel], system, baseline, round(ratio, 4), round(low, 4), round(high, 4),
                        round(cpu_ratio, 4), round(cpu_low, 4), round(cpu_high, 4),
                        len(ratios), round(mode_median(top), 5), round(mode_median(bottom), 5)))
    return rows


def render(rows: list[Row]) -> str:
    lines = [f"{'system':<38} {'against':<32} {'ratio':>6} {'95% CI':>16} {'cpu':>6} {'95% CI':>16} "
             f"{'rounds':>6} {'step_s':>7}"]
    for row in rows:
        lines.append(f"{row.system:<38} {row.baseline:<32} {row.ratio:6.3f} [{row.ci_low:5.3f}, {row.ci_high:5.3f}] "
                     f"{row.cpu_ratio:6.3f} [{row.cpu_ci_low:5.3f}, {row.cpu_ci_high:5.3f}] {row.rounds:6d} "
                     f"{row.step_s_median:7.4f}")
    lines.append("ratio: geometric mean over rounds of the two blocks' median step times (rank 0's wall clock; same "
                 "job, same data); cpu: the same of the CPU seconds of all ranks per step; CI: Student t over the "
                 "rounds' log ratios.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import results
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", default="ddp,fsdp,fsdp-tp", help="comma-separated: ddp, fsdp, fsdp-tp")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per parallelism (default: by parallelism)")
    parser.add_argument("--block-steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a few rounds each (a smoke check)")
    results.json_option(parser, "the rows as a JSON list")
    parser.add_argument("--keep", default="", help="a folder to keep each job's step times and events in")
    parser.add_argument("--nproc", type=int, default=4,
                        help="ranks (4: the demos' size; 2: one rank per core here, fsdp-tp a 1x2 mesh)")
    args = parser.parse_args(argv)
    if args.nproc < 2 or (args.nproc % 2 and "fsdp-tp" in args.parallel):
        parser.error(f"--nproc {args.nproc}: at least 2, and even for fsdp-tp (its tensor-parallel size is 2)")
    defaults = {"ddp": 20, "fsdp": 10, "fsdp-tp": 10}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="deadpool-injob-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for parallel in args.parallel.split(","):
            if parallel not in NAMES:
                parser.error(f"--parallel: unknown {parallel!r} (ddp, fsdp, fsdp-tp)")
            rounds = args.rounds or (3 if args.quick else defaults[parallel])
            rows += rows_of(parallel, run(parallel, rounds, args.block_steps, work, args.nproc))
    if args.json and args.json != "-":
        results.write(args.json, "overhead_injob", [asdict(r) for r in rows], nproc=args.nproc,
                      block_steps=args.block_steps)
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json == "-" else render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
