"""Slow-rank benchmark: a job's pace before a seat slows down, while it is slow, and after it is moved.

The GPT demo (4 ranks + 2 spares, ``--steps`` steps) with ``slow:rank=1:step=S:factor=3`` (rank 1
computes three times as long from step S on), run twice in one invocation: with ``--replace-slow``
(the coordinator reports the seat and moves it to a spare) and without (it reports it only). For each
run, rank 0's median step time (every synchronous step waits for the slowest seat) and tokens per second
before the slowdown, while the seat is slow, and after the move; the steps recomputed by the move; the
whole run's time; and whether the run ended with the failure-free digest (same invocation).

    python bench/slow.py [--steps 40] [--slow-step 8] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results  # noqa: E402
from deadpool.events import schema  # noqa: E402

WORLD, SPARES, FACTOR = 4, 2, 3.0
TOKENS = 8 * 64  # the demo's batch and context: tokens per rank and step


def run(workdir: Path, steps: int, slow_step: int, replace: bool | None) -> dict[str, Any]:
    """One job: failure-free (`replace` None), or slowed with --replace-slow on or off."""
    workdir.mkdir(parents=True, exist_ok=True)
    events_path = workdir / "events.jsonl"
    command = [sys.executable, "-m", "deadpool", "launch", "--no-progress", "--events", str(events_path),
               "--nproc", str(WORLD), "--spares", str(SPARES)]
    if replace is not None:
        command += ["--chaos", f"slow:rank=1:step={slow_step}:factor={FACTOR:g}"] + (["--replace-slow"] if replace
                                                                                      else [])
    command += [str(REPO / "demos" / "train_gpt.py"), "--steps", str(steps)]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    total = time.monotonic() - started
    events = schema.read(events_path) if events_path.exists() else []
    digest = [line for line in proc.stdout.splitlines() if line.startswith("final state digest: ")]
    result: dict[str, Any] = {"ok": proc.returncode == 0, "total_s": round(total, 2),
                              "digest": digest[-1].split()[-1] if digest else ""}
    rank0 = {r.step: r.step_s for r in events if isinstance(r, schema.StepFinished) and r.rank == 0
             and r.step is not None}
    moves = [r for r in events if isinstance(r, schema.ViewCommitted) and r.trigger == "move"]
    slow = [r for r in events if isinstance(r, schema.SeatSlow)]
    result["seat_slow_at"] = slow[0].step if slow else None
    moved_after = moves[0].resume_step if moves else None
    if moves:
        finished = max(r.step for r in events if isinstance(r, schema.StepFinished) and r.step is not None
                       and r.ts < moves[0].ts)
        result["steps_recomputed"] = max(0, finished - (moved_after or 0))
    phases = {"before": range(2, slow_step), "slow": range(slow_step + 2, (moved_after or steps - 1) + 1),
              "after": range((moved_after or steps) + 2, steps)}
    for name, span in phases.items():
        times = [rank0[step] for step in span if step in rank0]
        if times:
            step_s = statistics.median(times)
            result[f"{name}_step_s"] = round(step_s, 4)
            result[f"{name}_tokens_per_s"] = round(TOKENS * WORLD / step_s)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-step", type=int, default=8)
    results.json_option(parser, "the rows")
    args = parser.parse_args(argv)
    if not 3 <= args.slow_step < args.steps - 10:
        parser.error("--slow-step must leave 3 steps before it and 10 after it")
    root = Path(tempfile.mkdtemp(prefix="deadpool-slow-bench-"))
    rows = []
    reference = run(root / "reference", args.steps, args.slow_step, None)
    for name, replace in (("--replace-slow", True), ("reported only", False)):
        print(f"{name} ...", file=sys.stderr, flush=True)
        row = {"system": name, **run(root / name.strip("-").replace(" ", "-"), args.steps, args.slow_step, replace)}
        row["bit_identical"] = bool(row["digest"]) and row["digest"] == reference["digest"]
        rows.append(row)
    notes = [f"failure-free run of the same invocation: {reference.get('before_step_s')} s per step, "
             f"{reference['total_s']} s in all"]
    if args.json and args.json != "-":
        results.write(args.json, "slow", rows, notes,
                      config={"world": WORLD, "spares": SPARES, "steps": args.steps, "slow_step": args.slow_step,
                              "factor": FACTOR})
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['system']:16s} before {row.get('before_step_s')} s  slow {row.get('slow_step_s')} s  "
                  f"after {row.get('after_step_s', '-')} s  total {row['total_s']} s  "
                  f"bit-identical {row['bit_identical']}")
        for note in notes:
            print(note)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
