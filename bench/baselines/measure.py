"""Run every baseline once failure-free and once with one kill; print a table, save JSON.

Why a script: FINDINGS.md quotes these numbers, and they must be reproducible
with one command (the machine is shared, so each row records the load average).

    python -m bench.baselines.measure [--steps 40 --kill-step 20 --out /tmp/baselines.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.baselines._common import wait_for_quiet
from bench.baselines.restart_baseline import run_restart_baseline
from bench.baselines.torchft_baseline import run_torchft_baseline

COLUMNS = [
    "name",
    "ok",
    "total_s",
    "median_step_s",
    "mean_step_s",
    "recovery_s",
    "catchup_s",
    "rejoin_s",
    "steps_recomputed",
    "degraded_steps",
    "busy_share_before",
    "cpu_foreign_share",
]


def runs(steps: int, kill_rank: int, kill_step: int, root: Path, which: set[str]) -> list[tuple[str, Any]]:
    """(name, thunk) for every configuration to measure."""
    plan: list[tuple[str, Any]] = []
    for k in (1, 10):
        if "restart" in which:
            plan.append(
                (
                    f"torchrun K={k} no-failure",
                    lambda k=k: run_restart_baseline(steps, None, None, k, 4, root / f"restart-k{k}-ok"),
                )
            )
            plan.append(
                (
                    f"torchrun K={k} kill@{kill_step}",
                    lambda k=k: run_restart_baseline(steps, kill_rank, kill_step, k, 4, root / f"restart-k{k}-kill"),
                )
            )
    if "restart" in which:
        # At kill_step=20 a K=10 checkpoint was just written; half an interval later
        # shows the lost work that K=10 usually costs.
        late = kill_step + 5
        plan.append(
            (
                f"torchrun K=10 kill@{late}",
                lambda: run_restart_baseline(steps, kill_rank, late, 10, 4, root / "restart-k10-kill-late"),
            )
        )
    if "relaunch" in which:
        plan.append(
            (
                f"full relaunch K=10 kill@{kill_step}",
                lambda: run_restart_baseline(
                    steps, kill_rank, kill_step, 10, 4, root / "relaunch-k10-kill", mode="relaunch"
                ),
            )
        )
    if "torchft" in which:
        plan.append(("torchft no-failure", lambda: run_torchft_baseline(steps, None, None, root / "torchft-ok")))
        plan.append(
            (
                f"torchft kill@{kill_step}",
                lambda: run_torchft_baseline(steps, kill_rank, kill_step, root / "torchft-kill"),
            )
        )
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--root", default="/tmp/deadpool-baselines")
    parser.add_argument("--out", default="/tmp/deadpool-baselines/results.json")
    parser.add_argument("--only", nargs="*", default=["restart", "relaunch", "torchft"])
    parser.add_argument("--quiet-wait", type=float, default=90.0, help="max seconds to wait for an idle machine")
    args = parser.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for name, thunk in runs(args.steps, args.kill_rank, args.kill_step, root, set(args.only)):
        busy = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else -1.0
        began = time.monotonic()
        result = thunk()
        result["name"] = name
        result["busy_share_before"] = busy
        results.append(result)
        print(f"{name}: ok={result.get('ok')} in {time.monotonic() - began:.1f}s", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(" | ".join(COLUMNS))
    for result in results:
        print(" | ".join(str(result.get(c, "")) for c in COLUMNS))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
