"""Scale benchmark: what one coordinator costs from 1,024 to 131,072 members (deterministic simulation).

Every row is one ``deadpool simulate`` run (``deadpool.tools.simulate.scaled``): the
real coordinator on a virtual clock, simulated members speaking the real protocol
through the real codec, the real 1 MiB control-frame limit, seeded failures (hangs,
crashes, zombies; one during a view change, one on a spare).  Reported per row:

- ``hb s``: the heartbeat interval (virtual s); ``fails``: failures injected
  (``--failures``, at most half the spares, so that no row runs out of spares);
- ``msgs/s``: messages the coordinator handles per virtual second in steady state;
- ``cpu s/s``: real coordinator CPU per virtual second over the whole run
  (startup, steady state and every view change): below 1, one core keeps up;
- ``start s``: coordinator CPU from the first Join to the first view;
- ``change s``: the most coordinator CPU spent in one 10 ms tick that prepared
  or committed a view (the real coordinator reads nothing else for that long);
- ``detect`` and ``change``: virtual seconds from death to ``member_failed``
  and from there to the committed view without the member (p50; ``p99`` too);
- ``frame KiB``: the largest frame the coordinator sent (views go as deltas or
  512 KiB pieces); ``viol``: invariant violations; ``swaps``: swaps completed
  (a failure that strikes a spare is resolved without one).

Modes: ``plain`` (one Heartbeat per member per interval) and ``batched`` (one
HostHeartbeat per host of 8 members per interval, as ``deadpool launch`` agents
send).  ``plain`` rows above ``--plain-max`` members are not run: at 0.1-2 s
intervals a coordinator handling every member's beat spends more than a core
(it is printed as capped).

Usage::

    python bench/simulate_scale.py              # 1,024 .. 131,072 members: about 10 minutes on 2 cores
    python bench/simulate_scale.py --quick      # 1,024 .. 16,384 members
    python bench/simulate_scale.py --json       # one JSON object per row instead of the table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deadpool.tools.simulate import SimConfig, scaled, simulate  # noqa: E402

SIZES = (1024, 4096, 16384, 32768, 65536, 131072)
QUICK_SIZES = (1024, 4096, 16384)


def rows(sizes: tuple[int, ...], failures: int, seed: int, plain_max: int) -> list[tuple[str, SimConfig | None]]:
    plan: list[tuple[str, SimConfig | None]] = []
    for members in sizes:
        fails = min(failures, max(1, SimConfig(members=members).spares // 2))
        for mode, batched in (("plain", False), ("batched", True)):
            if not batched and members > plain_max:
                plan.append((mode, None))
                continue
            plan.append((mode, scaled(members, fails, seed, aggregate=batched)))
    return plan


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import results
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 to 16,384 members only")
    results.json_option(parser, "one JSON object per row")
    parser.add_argument("--failures", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plain-max", type=int, default=16384, help="largest job run without batching")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.perf_counter()
    measured: list[dict[str, Any]] = []
    if not args.json:
        print(f"coordinator scale, simulated: up to {args.failures} failures, seed {args.seed}, 10 ms ticks; "
              "detect/change: virtual s; cpu: real s")
        print(f"{'members':>7} {'mode':<8} {'hb s':>5} {'fails':>5} {'msgs/s':>8} {'cpu s/s':>7} {'start s':>7} "
              f"{'change s':>8} {'detect':>6} {'change':>6} {'p99':>5} {'frame KiB':>9} {'viol':>4} {'swaps':>5} "
              f"{'job':<7} {'wall s':>6}")
    for mode, config in rows(sizes, args.failures, args.seed, args.plain_max):
        if config is None:
            measured.append({"mode": mode, "not_run": f"above --plain-max {args.plain_max} members"})
            if not args.json:
                print(f"{'':>7} {mode:<8} (not run: above --plain-max {args.plain_max:,} members, every member's "
                      "beat costs the coordinator more than a core)")
            continue
        result = simulate(config)
        measured.append({"mode": mode, "members": config.members, "heartbeat_interval": config.heartbeat_interval,
                         **result})
        if args.json == "-":
            print(json.dumps({"mode": mode, **result}), flush=True)
            continue
        if args.json:
            continue
        print(f"{config.members:>7} {mode:<8} {config.heartbeat_interval:>5.3g} {result['failures_injected']:>5} "
              f"{result['coordinator_msgs_per_s']:>8,.0f} {result['coordinator_cpu_s_per_s']:>7.3f} "
              f"{result['cpu_startup_s']:>7.2f} {result['cpu_view_change_s_max']:>8.3f} "
              f"{fmt(result['detect_s_p50'], '.2f'):>6} {fmt(result['view_change_s_p50'], '.2f'):>6} "
              f"{fmt(result['view_change_s_p99'], '.2f'):>5} {result['max_frame_bytes'] / 1024:>9,.0f} "
              f"{result['invariant_violations']:>4} {result['swaps_completed']:>5} {result['job']:<7} "
              f"{result['wall_s']:>6.1f}", flush=True)
    if args.json and args.json != "-":
        results.write(args.json, "simulate_scale", measured, failures=args.failures, seed=args.seed,
                      wall_s=round(time.perf_counter() - started, 1))
    if not args.json:
        print(f"(total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
