"""Results files: what a benchmark's ``--json PATH`` writes, and what ``bench/figures.py`` reads.

One file is one run of one benchmark: the date, the machine (CPU model, cores, memory, from
``/proc``), the git commit of the tree it ran from, the exact command, the torch version, and the
rows it measured.  The documentation's figures are generated from these files (``docs/results/``),
so every figure names the run it came from.

``--json`` with no path keeps each benchmark's old behaviour (the rows on stdout).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FORMAT = 1  # the results file's layout; bump when a reader must tell layouts apart


def json_option(parser: Any, what: str) -> None:
    """Add ``--json [PATH]``: without PATH print `what` as JSON; with PATH write a results file there."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help=f"print {what} as JSON; with PATH, write a results file there (date, machine, "
                             "commit, command and the rows: docs/results/, read by bench/figures.py)")


def machine() -> dict[str, Any]:
    """This machine, from /proc where Linux has it: CPU model, logical cores, memory."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": memory_gib, "arch": platform.machine(),
            "kernel": platform.release(), "python": platform.python_version()}


def git_commit() -> dict[str, Any]:
    """The commit the tree was at, and whether the tree had uncommitted changes (``dirty``)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return ""


def write(path: str, benchmark: str, rows: Any, notes: list[str] | None = None, **extra: Any) -> Path:
    """Write one run's results file at `path` (folders created); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [Path(sys.argv[0]).as_posix()] if sys.argv and sys.argv[0] else []
    if argv and Path(argv[0]).is_absolute():
        try:
            argv[0] = Path(argv[0]).relative_to(REPO).as_posix()
        except ValueError:
            pass
    document = {
        "format": FORMAT,
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", *argv, *sys.argv[1:]]),
        "machine": machine(),
        "torch": torch_version(),
        **git_commit(),
        "load_average": round(os.getloadavg()[0], 2),
        **extra,
        "notes": notes or [],
        "rows": rows,
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"results written to {out}", file=sys.stderr)
    return out
