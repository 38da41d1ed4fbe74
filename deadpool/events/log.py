"""Structured events: one JSON object per line, appended by every process of a job.

Each line has ``ts``, ``event``, ``epoch``, ``member``, ``rank``, ``step`` and
fields of its own, so a person can read the file and a tool can plot it
(``deadpool events FILE --plot``).  Lines are written with a single
``write`` on an ``O_APPEND`` descriptor, so processes sharing the file never
interleave inside a line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from deadpool.events.catalogue import Event

log = logging.getLogger("deadpool.events.log")


class EventLog:
    """Appends events for one process; the identity fields are filled in for every line."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        member: str = "",
        source: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock  # wall clock, or the simulator's virtual one
        self.records: list[dict[str, Any]] | None = None  # set to a list to also keep events in memory
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # e.g. the coordinator's metrics
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1
        self._lock = threading.Lock()
        self.member = member
        self.source = source
        self.epoch = 0
        self.rank = -1
        self.step = -1

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        """Write one event line; identity fields given here override the defaults."""
        record: dict[str, Any] = {
            "ts": round(self._clock(), 6),
            "event": event,
            "epoch": self.epoch,
            "member": self.member,
            "rank": self.rank,
            "step": self.step,
        }
        if self.source:
            record["source_process"] = self.source
        record.update(fields)
        if self.records is not None:
            self.records.append(record)
        for listener in self.listeners:
            listener(record)
        if log.isEnabledFor(logging.INFO):
            log.info("%s %s", event, {k: v for k, v in record.items() if k not in ("ts", "event")})
        if self._fd >= 0:
            line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
            with self._lock:
                os.write(self._fd, line)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a file in order, skipping (and logging) unreadable lines.

    A last line without its newline may be a write still in progress (a reader can
    see half of one ``write``); it is skipped without a warning.
    """
    with Path(path).open() as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if raw.endswith("\n"):
                    log.warning("%s:%d is not a JSON event line; skipped", path, number)
                continue
            if isinstance(record, dict):
                yield record
