"""Who has been silent too long, found in time proportional to the silent, not to the job.

Members are kept in the order they were last heard from (a dict moved-to-end on
every accepted message), so the periodic check reads only the oldest entries and
stops at the first recent one. At 131,072 members a scan of everyone every 10 ms
tick cost more than a core; this costs one dict move per message.
"""

from __future__ import annotations

import collections
import itertools


class Liveness:
    """Last-heard times, oldest first."""

    def __init__(self) -> None:
        self._heard: dict[str, float] = {}
        self._newest = float("-inf")
        self._sorted = True  # False after an out-of-order time (a takeover hands over older silences)

    def seen(self, member: str, when: float) -> None:
        heard = self._heard
        heard.pop(member, None)
        heard[member] = when
        if when >= self._newest:
            self._newest = when
        else:
            self._sorted = False

    def seen_all(self, members: list[str], when: float) -> None:
        """Each of `members` heard at `when` (an agent's batch of answers): moved to the end in C."""
        heard = self._heard
        collections.deque(map(heard.pop, members, itertools.repeat(None)), maxlen=0)
        heard.update(dict.fromkeys(members, when))
        if when >= self._newest:
            self._newest = when
        else:
            self._sorted = False

    def forget(self, member: str) -> None:
        self._heard.pop(member, None)

    def all_seen(self, when: float) -> None:
        """Everyone counts as heard at `when` (this process did not run for a while: no silence is known)."""
        self._heard = dict.fromkeys(self._heard, when)
        self._newest, self._sorted = max(self._newest, when), True

    def silent(self, now: float, timeout: float) -> dict[str, float]:
        """Members not heard from for more than `timeout`, with when they were last heard."""
        if not self._sorted:
            self._heard = dict(sorted(self._heard.items(), key=lambda item: item[1]))
            self._sorted = True
        found: dict[str, float] = {}
        for member, when in self._heard.items():
            if now - when <= timeout:
                break
            found[member] = when
        return found
