"""Scale benchmark: what one coordinator costs from 64 to 16,384 members (deterministic simulation).

Every row is one ``deadpool.tools.simulate`` run: the real coordinator on a virtual
clock, simulated members speaking the real protocol, seeded failures (a hang,
a crash, a zombie; one during a view change).  Reported per row:

- ``msgs/s``: messages the coordinator handles per virtual second in steady
  state (deterministic);
- ``handle s/s``: real CPU seconds the coordinator spends per virtual second
  in steady state on decode + ``handle()`` + encoding its sends (the transport's
  own per-message cost is not included: see ``bench/transport.py``);
- ``tick ms``: real CPU of one ``Coordinator.tick()`` (the serve loop of
  ``deadpool/coordinator/main.py`` runs it at least every 50 ms, and after every
  inbox drain under load);
- ``change s``: the most coordinator CPU spent in one 10 ms tick that prepared
  or committed a view (Prepare broadcast, every ack, the commit broadcast):
  the real coordinator reads no heartbeat for that long;
- ``start s``: coordinator CPU from the first Join to the first view;
- ``detect`` and ``change``: virtual seconds from death to ``member_failed``
  and from there to the committed view without the member (p50);
- ``view KiB``: one encoded ``CommitView``; ``!`` marks views over the workers'
  1 MiB control-frame limit (``CONTROL_LIMITS``).  Every row here runs with an
  8 MiB limit so that the protocol can be measured past that point.

Modes: ``plain`` (one Heartbeat per member per interval), ``aggregate`` (one
HeartbeatBatch per host of 8 members) and, from 8,192 members, ``agg+adaptive``
(aggregation with ``simulate.adaptive_interval``).

Usage::

    python bench/simulate_scale.py            # 64 .. 16,384 members: a few minutes on 2 cores
    python bench/simulate_scale.py --quick    # 64 .. 1,024 members: under a minute
    python bench/simulate_scale.py --json     # one JSON object per row instead of the table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deadpool.tools.simulate import SimConfig, adaptive_interval, simulate  # noqa: E402

SIZES = (64, 256, 1024, 4096, 16384)
QUICK_SIZES = (64, 256, 1024)
REAL_FRAME_LIMIT = 1 << 20
BENCH_FRAME_LIMIT = 8 << 20


def rows(sizes: tuple[int, ...], failures: int, seed: int, duration: float) -> list[tuple[int, str, SimConfig]]:
    plan = []
    for members in sizes:
        base = SimConfig(members=members, failures=failures, seed=seed, duration=duration,
                         max_frame_bytes=BENCH_FRAME_LIMIT)
        plan.append((members, "plain", base))
        plan.append((members, "aggregate", replace(base, aggregate=True)))
        if adaptive_interval(members) > base.heartbeat_interval:
            plan.append((members, "agg+adaptive",
                         replace(base, aggregate=True, heartbeat_interval=adaptive_interval(members))))
    return plan


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 to 1,024 members only")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--failures", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0, help="virtual seconds")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.perf_counter()
    header = (f"{'members':>7} {'mode':<12} {'hb s':>5} {'msgs/s':>9} {'handle s/s':>10} {'tick ms':>8} "
              f"{'change s':>8} {'start s':>7} {'detect':>7} {'change':>7} {'view KiB':>9} {'viol':>4} {'job':<8} "
              f"{'wall s':>7}")
    if not args.json:
        print(f"coordinator scale, simulated: {args.failures} failures, seed {args.seed}, "
              f"{args.duration:g} virtual s, 10 ms ticks; detect/change: virtual s (p50); other s: real CPU")
        print(header)
    for members, mode, config in rows(sizes, args.failures, args.seed, args.duration):
        result = simulate(config)
        row = {"mode": mode, **result}
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        over = "!" if result["view_frame_bytes"] > REAL_FRAME_LIMIT else " "
        print(f"{members:>7} {mode:<12} {config.heartbeat_interval:>5.3g} {result['coordinator_msgs_per_s']:>9,.0f} "
              f"{result['cpu_handle_s_per_s']:>10.3f} {result['cpu_tick_ms']:>8.2f} "
              f"{result['cpu_view_change_s_max']:>8.3f} {result['cpu_startup_s']:>7.2f} "
              f"{fmt(result['detect_s_p50'], '.2f'):>7} {fmt(result['view_change_s_p50'], '.2f'):>7} "
              f"{result['view_frame_bytes'] / 1024:>8,.0f}{over} {result['invariant_violations']:>4} "
              f"{result['job']:<8} {result['wall_s']:>7.1f}", flush=True)
    if not args.json:
        print(f"(total {time.perf_counter() - started:.0f} s; '!' = CommitView over the real 1 MiB frame limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
