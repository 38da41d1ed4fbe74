"""The progress line of ``deadpool launch``: startup, steps done, tokens/s, spares left, swaps.

It follows this host's events file (never the coordinator, so it cannot slow the control
plane down), folds the records (``events.schema``, read as ``events.summary`` facts) into a small
``JobProgress``, and shows it as a ``rich`` live display on a terminal or as a plain line
every ``interval`` seconds otherwise.  Progress is decoration: any error here is logged
and ends the display, never the job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

from deadpool.events import schema, summary

log = logging.getLogger("deadpool.agent.progress")

TOKENS_WINDOW_S = 10.0  # tokens/s is the rate over this much recent wall time
MIN_RATE_SPAN_S = 1.0  # no rate from reports closer together than this
READ_LIMIT = 4 << 20  # bytes read from the events file per poll (a burst is read over several polls)


@dataclass
class JobProgress:
    """What a person wants to see of a running job, folded from its event records."""

    seats: int  # seats in the job (nnodes * nproc)
    spares_started: int = 0  # spares this launcher started (the count until a view says otherwise)
    ranks_joined: int = 0
    spares_joined: int = 0
    epoch: int = 0
    spares_left: int | None = None  # from the newest view_committed
    step: int = -1  # newest finished step (it goes back after a rollback)
    failures: int = 0
    swaps: int = 0
    last_recovery_s: float | None = None
    outcome: str = ""  # "finished" or "failed: reason" once known
    _tokens: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=10_000))

    def feed(self, record: schema.Line) -> None:
        """Fold one event in; events it does not count are ignored."""
        match summary.parse(record):
            case summary.MemberJoined(process="worker") as joined:
                if joined.spare:
                    self.spares_joined += 1
                else:
                    self.ranks_joined += 1
            case summary.ViewCommit() as view:
                self.epoch = max(self.epoch, view.epoch or 0)
                if view.spares is not None:
                    self.spares_left = len(view.spares)
            case summary.StepDone(step=int() as step) as done:
                self.step = step
                if done.tokens is not None and done.ts is not None:
                    self._tokens.append((done.ts, done.tokens))
            case summary.Failure(rank=int() as rank) if rank >= 0:
                self.failures += 1
            case summary.Swap() as swap:
                self.swaps += 1
                if swap.recovery_s is not None:
                    self.last_recovery_s = swap.recovery_s
            case summary.JobFinished() as finished:
                self.outcome = f"finished at step {finished.step}"
            case summary.JobFailed():
                self.outcome = "FAILED"

    @property
    def started(self) -> bool:
        """Whether a step finished yet (until then the job is starting: imports, model, rendezvous)."""
        return self.step >= 0

    def tokens_per_s(self) -> float | None:
        """Tokens of every seat per second of wall time over the recent window (None before two reports)."""
        if len(self._tokens) < 2:
            return None
        newest = self._tokens[-1][0]
        window = [(ts, n) for ts, n in self._tokens if ts >= newest - TOKENS_WINDOW_S]
        span = window[-1][0] - window[0][0]
        if span < MIN_RATE_SPAN_S:  # the seats' reports of one step land together: no rate yet
            return None
        first = window[0][0]
        return sum(n for ts, n in window if ts > first) / span  # what was done after the window opened

    def line(self) -> str:
        """One plain line, e.g. ``step 41 | 9,120 tok/s | spares 1 | view epoch 3 | 1 swap (0.92 s)``."""
        if self.outcome:
            head = self.outcome
        elif not self.started:
            head = f"starting: {self.ranks_joined}/{self.seats} ranks and {self.spares_joined} spares joined"
        else:
            head = f"step {self.step}"
        parts = [head]
        rate = self.tokens_per_s()
        if rate is not None and self.started:
            parts.append(f"{rate:,.0f} tok/s")
        spares = self.spares_left if self.spares_left is not None else self.spares_started
        parts.append(f"spares {spares}")
        parts.append(f"view epoch {self.epoch}")  # the job's view number, not a pass over the data
        if self.failures:
            swaps = f"{self.swaps} swap{'s' if self.swaps != 1 else ''}"
            if self.last_recovery_s is not None:
                swaps += f" (last {self.last_recovery_s:.2f} s)"
            parts.append(f"{self.failures} failure{'s' if self.failures != 1 else ''}, {swaps}")
        if self.failures > self.swaps and not self.outcome:
            parts.append("recovering")
        return " | ".join(parts)


class EventTail:
    """Reads the records appended to an events file since the last call (whole lines only)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[schema.Line]:
        """New records, validated by the event schema; a missing file (not created yet) reads as none.

        A line that does not match its kind's schema is logged and skipped: the readers of a live
        file are decoration, which must not stop the job."""
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read(READ_LIMIT)
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            if not line.strip():
                continue
            try:
                records.append(schema.decode(line, self._path))
            except schema.SchemaError as err:
                log.warning("%s", err)
        return records


def _render_rich(progress: JobProgress) -> Any:
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    text = Text("deadpool: " + progress.line(), style="bold cyan")
    if progress.started or progress.outcome:
        return text
    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=max(1, progress.seats + progress.spares_started),
                             completed=progress.ranks_joined + progress.spares_joined, width=30), text)
    return Group(grid)


async def follow(events_path: str, seats: int, spares: int, interval: float = 10.0, poll: float = 0.5,
                 stream: TextIO | None = None) -> None:
    """Show the job's progress until cancelled (the launcher cancels it when the job ends)."""
    out = stream if stream is not None else sys.stdout
    progress = JobProgress(seats=seats, spares_started=spares)
    tail = EventTail(events_path)
    tty = out.isatty() and os.environ.get("TERM") != "dumb"
    try:
        if tty:
            await _follow_live(progress, tail, poll)
        else:
            await _follow_plain(progress, tail, interval, poll, out)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # progress is decoration: it must never take the launcher down
        log.warning("progress display stopped: %s", err)


async def _follow_plain(progress: JobProgress, tail: EventTail, interval: float, poll: float, out: TextIO) -> None:
    loop = asyncio.get_running_loop()
    last_line = ""
    next_print = loop.time() + interval
    while True:
        for record in tail.read():
            progress.feed(record)
        now = loop.time()
        if now >= next_print:
            line = progress.line()
            if line != last_line:
                out.write(f"deadpool: {line}\n")
                out.flush()
                last_line = line
            next_print = now + interval
        await asyncio.sleep(poll)


async def _follow_live(progress: JobProgress, tail: EventTail, poll: float) -> None:
    from rich.console import Console
    from rich.live import Live

    with Live(_render_rich(progress), console=Console(), refresh_per_second=4, transient=True,
              redirect_stdout=True, redirect_stderr=True) as live:
        while True:
            for record in tail.read():
                progress.feed(record)
            live.update(_render_rich(progress))
            await asyncio.sleep(poll)
