"""Deterministic simulation of a large job around the real coordinator (``deadpool simulate``).

For thousands of members and a seeded schedule of failures (crashes, hangs,
zombies, spares, a second failure during a view change), it checks that the
membership protocol keeps its invariants and measures what one coordinator
costs: messages per second, CPU per virtual second, detection and view-change
time.  The coordinator is the real, sans-I/O one, on a virtual clock; members
and agents are simulated (``cluster.py``), the loop routes what the coordinator
returns to them (``loop.py``), and ``checks.py`` holds the invariants and the
metrics.  Metrics named in :data:`REAL_TIME_KEYS` are real-time measurements;
every other one is a deterministic function of the configuration and seed.
"""

from __future__ import annotations

from deadpool.errors import MisuseError

from .checks import REAL_TIME_KEYS, format_table
from .cluster import SimConfig
from .loop import AGGREGATE_FROM, Simulation, adaptive_interval, scaled, simulate

run = simulate  # the name the command line may use: run(SimConfig(...)) -> metrics

__all__ = [
    "AGGREGATE_FROM",
    "REAL_TIME_KEYS",
    "MisuseError",
    "SimConfig",
    "Simulation",
    "adaptive_interval",
    "format_table",
    "run",
    "scaled",
    "simulate",
]
