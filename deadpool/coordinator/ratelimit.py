"""The coordinator's per-member rate limit: a runaway or hostile member cannot flood it.

A token bucket per sender (``RATE_PER_S`` sustained, bursts up to ``RATE_BURST``);
a refused message is logged as a ``rejected`` event, the first few and then every
thousandth, so a flood cannot flood the events file either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool.events import schema
from deadpool.events.log import EventLog

RATE_PER_S = 200.0  # sustained messages per member per second (heartbeats are 4/s)
RATE_BURST = 400.0  # short bursts allowed above that (a swap's acks and reports)


@dataclass
class RateLimit:
    events: EventLog
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # member -> (tokens, last refill)
    refused: dict[str, int] = field(default_factory=dict)  # member -> messages refused so far

    def allow(self, sender: str, now: float) -> bool:
        tokens, last = self.buckets.get(sender, (RATE_BURST, now))
        tokens = min(RATE_BURST, tokens + (now - last) * RATE_PER_S)
        if tokens < 1.0:
            self.buckets[sender] = (tokens, now)
            count = self.refused[sender] = self.refused.get(sender, 0) + 1
            if count <= 5 or count % 1000 == 0:
                self.events.emit(schema.Rejected(reason="rate_limited", peer=sender, count=count,
                                 detail=f"more than {RATE_PER_S:.0f} messages/s sustained"))
            return False
        self.buckets[sender] = (tokens - 1.0, now)
        return True
