"""The agent's own logic, without processes: what it does with frames it cannot use."""

from __future__ import annotations

import pytest

from deadpool.agent.launch import DropLog


def test_the_agent_logs_every_dropped_frame_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    drops = DropLog(interval=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="deadpool.agent.launch"):
        assert drops.note("bad_mac (wrong secret)")
        assert not drops.note("bad_mac (wrong secret)")
        assert not drops.note("unexpected Heartbeat")
        now[0] = 10.0
        assert drops.note("bad_mac (wrong secret)")
    assert drops.dropped == 4
    assert [r.getMessage() for r in caplog.records] == [
        "dropped a frame from the control socket: bad_mac (wrong secret)",
        "dropped a frame from the control socket: bad_mac (wrong secret) (and 2 more dropped frames since the last "
        "report)",
    ]
