"""Structured events: one JSON object per line, appended by every process of a job.

A writer builds a typed record (``events.schema``: one per event kind) and hands it to
``EventLog.emit``, which fills in the envelope the writer left out (its member, epoch, rank,
step, the time and the kind of process) and appends the line.  A person can read the file and
a tool can plot it (``deadpool events FILE --plot``); readers go through ``schema.read``.
Lines are written with a single ``write`` on an ``O_APPEND`` descriptor, so processes sharing
the file never interleave inside a line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from deadpool.events.schema import EventRecord, Record, decode, encode

log = logging.getLogger("deadpool.events.log")

R = TypeVar("R", bound=Record)


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
        self.records: list[EventRecord] | None = None  # set to a list to also keep events in memory
        self.listeners: list[Callable[[EventRecord], None]] = []  # e.g. the coordinator's metrics
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1
        self._lock = threading.Lock()
        self.member = member
        self.source = source
        self.epoch = 0
        self.rank = -1
        self.step = -1

    def emit(self, record: R) -> R:
        """Write one event line; the envelope fields `record` leaves ``None`` are this log's.  Returns the
        record as written."""
        full = msgspec.structs.replace(
            record,
            ts=round(self._clock(), 6),
            epoch=self.epoch if record.epoch is None else record.epoch,
            member=self.member if record.member is None else record.member,
            rank=self.rank if record.rank is None else record.rank,
            step=self.step if record.step is None else record.step,
            source_process=record.source_process or self.source,
        )
        line = encode(full)
        decode(line, f"{full.event} as written")  # a wrong type fails here, not in a reader
        if self.records is not None:
            self.records.append(full)  # type: ignore[arg-type]
        for listener in self.listeners:
            listener(full)  # type: ignore[arg-type]
        if log.isEnabledFor(logging.INFO):
            log.info("%s %s", full.event, {k: v for k, v in full.fields().items() if k not in ("ts", "event")})
        if self._fd >= 0:
            with self._lock:
                os.write(self._fd, line)
        return full

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
