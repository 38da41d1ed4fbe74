"""The deterministic simulation (``deadpool simulate``): invariants, determinism, and its own checker.

Small jobs (64 and 256 members) on a virtual clock, fixed seeds; the whole file
runs in seconds.  The last tests break the coordinator on purpose to show that
the invariant checker is not vacuous, and test the HeartbeatBatch handling
that hierarchical aggregation added to the coordinator.
"""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
from deadpool.tools import cli, simulate
from deadpool.tools.simulate import REAL_TIME_KEYS, SimConfig

from deadpool.agent.relay import HELLO_EVERY_S
from deadpool.config import COORDINATOR_GC, Config
from deadpool.coordinator.decisions import Trigger
from deadpool.coordinator.rounds import Rounds
from deadpool.coordinator.service import Coordinator
from deadpool.coordinator.views import Views
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector
from deadpool.protocol import codec
from deadpool.protocol.messages import AgentHello, Fenced, Heartbeat, HeartbeatBatch, Join

REQUIRED = ("members", "failures", "views_committed", "invariant_violations", "detect_s_p50",
            "view_change_s_p50", "coordinator_msgs_per_s", "wall_s")


def deterministic(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in REAL_TIME_KEYS}


@pytest.mark.parametrize(("members", "failures", "seed", "aggregate"), [
    (64, 2, 1, False),
    (256, 4, 2, False),
    (256, 4, 3, True),
])
def test_failures_are_swapped_and_invariants_hold(members: int, failures: int, seed: int, aggregate: bool) -> None:
    result = simulate.simulate(SimConfig(members=members, failures=failures, seed=seed, aggregate=aggregate))
    assert result["invariant_violations"] == 0, result["violations"]
    assert result["failures_injected"] == failures
    assert result["job"] == "running", result["job_failure_reason"]
    assert result["views_committed"] >= 2  # the first view and at least one swap
    assert result["false_positives"] == 0
    assert result["detect_s_p50"] is not None and result["detect_s_max"] <= 2.2  # failure_timeout + a beat
    assert result["view_change_s_p50"] is not None


def test_swapped_seats_report_their_first_step() -> None:
    result = simulate.simulate(SimConfig(members=64, failures=2, seed=1))
    assert result["swaps_completed"] == 2  # both seats lost, both adopted spares finished a step


def test_the_run_collects_garbage_as_a_coordinator_does_and_then_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, ...]] = []
    sim = simulate.Simulation(SimConfig(members=64, failures=1, seed=1))
    run = sim._run
    monkeypatch.setattr(sim, "_run", lambda: (seen.append(gc.get_threshold()), run())[1])
    before = gc.get_threshold()
    assert before != COORDINATOR_GC
    sim.run()
    assert seen == [COORDINATOR_GC]
    assert gc.get_threshold() == before


def test_a_zombie_is_rejected_and_told_it_is_fenced() -> None:
    # Seed 4 makes one of the three failures a zombie that wakes up after it was replaced.
    result = simulate.simulate(SimConfig(members=64, failures=3, seed=4))
    assert result["invariant_violations"] == 0, result["violations"]
    assert result["fenced_rejections"] >= 1


def test_same_seed_same_metrics() -> None:
    config = SimConfig(members=128, failures=3, seed=7)
    first, second = simulate.simulate(config), simulate.simulate(config)
    assert deterministic(first) == deterministic(second)
    other = simulate.simulate(dataclasses.replace(config, seed=8))
    assert deterministic(other) != deterministic(first)


def test_more_failures_than_spares_ends_in_a_reported_job_failure() -> None:
    config = SimConfig(members=64, failures=8, seed=5)  # 3 spares
    result = simulate.simulate(config)
    assert result["job"] == "failed"
    assert "no spare" in result["job_failure_reason"]
    assert result["invariant_violations"] == 0, result["violations"]
    assert result["virtual_s"] < config.duration  # ended when the job failed, not at a time limit


def test_a_view_over_the_frame_limit_is_dropped_and_the_job_fails_cleanly() -> None:
    # A 64-member view is ~7 kB; with a 4 kB limit no member ever holds a view, so nobody can answer
    # Prepare: the coordinator must end the job (prepare timeout, then no spares), not hang.
    result = simulate.simulate(SimConfig(members=64, failures=1, seed=1, max_frame_bytes=4000))
    assert result["frames_dropped_oversize"] > 0 and result["view_frame_bytes"] > 4000
    assert result["job"] == "failed"
    assert result["invariant_violations"] == 0, result["violations"]
    assert "--max-frame-bytes" in simulate.format_table(result)


def test_aggregation_divides_the_coordinators_message_rate() -> None:
    plain = simulate.simulate(SimConfig(members=256, failures=0, seed=1))
    batched = simulate.simulate(SimConfig(members=256, failures=0, seed=1, aggregate=True))
    hellos = 256 / 8 / HELLO_EVERY_S  # each host's agent says hello every second, batched or not
    assert plain["coordinator_msgs_per_s"] == pytest.approx(256 / 0.1 + hellos)
    assert batched["coordinator_msgs_per_s"] == pytest.approx(256 / 8 / 0.1 + hellos)
    assert plain["invariant_violations"] == batched["invariant_violations"] == 0


def test_cli_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--members", "64", "--failures", "1", "--seed", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(key in result for key in REQUIRED)
    assert result["members"] == 64 and result["failures"] == 1


def test_bad_configuration_is_a_misuse() -> None:
    with pytest.raises(simulate.MisuseError):
        SimConfig(members=2).validate()
    with pytest.raises(simulate.MisuseError):
        SimConfig(duration=1.0).validate()


# -- the checker catches a broken coordinator ---------------------------------------------------


class _AcceptsFenced(Coordinator):
    """Bug on purpose: a fenced member's message refreshes its record before being rejected."""

    def handle(self, now, message):  # type: ignore[no-untyped-def]
        sender = getattr(message, "sender", None)
        if isinstance(sender, str) and sender in self.fenced and sender in self.members:
            self.members[sender].last_seen += 1.0
        return super().handle(now, message)


def _commits_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug on purpose: every view after a failure is committed twice under the same epoch."""
    commit = Views.commit

    def twice(self, view, reason, failed, trigger):  # type: ignore[no-untyped-def]
        commit(self, view, reason, failed, trigger)
        if failed:
            commit(self, view, f"{reason} (again)", failed, trigger)

    monkeypatch.setattr(Views, "commit", twice)


def test_checker_catches_a_fenced_member_accepted() -> None:
    result = simulate.simulate(SimConfig(members=64, failures=3, seed=4), coordinator_class=_AcceptsFenced)
    assert result["invariant_violations"] > 0
    assert any("fenced member" in text for text in result["violations"])


def test_checker_catches_two_views_for_one_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    _commits_twice(monkeypatch)
    result = simulate.simulate(SimConfig(members=64, failures=1, seed=1))
    assert any("committed twice" in text for text in result["violations"])


def _labels_every_round_blind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug on purpose: every round is labelled a blind rebuild, whatever its (unchanged) reason says."""
    start = Rounds.start

    def blind(self, now, newly_failed, reason, trigger, **keywords):  # type: ignore[no-untyped-def]
        start(self, now, newly_failed, reason, Trigger.BLIND_REBUILD, **keywords)

    monkeypatch.setattr(Rounds, "start", blind)


def test_spurious_rebuilds_are_counted_by_the_trigger_field_not_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = simulate.simulate(SimConfig(members=64, failures=2, seed=1))
    _labels_every_round_blind(monkeypatch)
    mislabelled = simulate.simulate(SimConfig(members=64, failures=2, seed=1))
    assert honest["spurious_rebuilds"] == 0
    assert mislabelled["spurious_rebuilds"] >= 2  # one round per lost seat, each counted by its trigger


# -- HeartbeatBatch at the coordinator ----------------------------------------------------------


def test_heartbeat_batch_counts_only_the_agents_own_live_members() -> None:
    now = [0.0]
    events = EventLog(None, clock=lambda: now[0])
    events.records = []
    coordinator = Coordinator(Config(), 2, "store:1", events, wall_clock=lambda: now[0])
    coordinator.handle(now[0], AgentHello("agent-a", "h0", "inproc://agent-a", {"m0": 1, "m1": 2}))
    for i, member in enumerate(("m0", "m1", "m2")):
        coordinator.handle(now[0], Join(member, "active" if i < 2 else "spare", i if i < 2 else -1, 2, 10 + i, "h0",
                                        f"inproc://{member}", f"tcp://h0:{i}"))
    assert coordinator.view is not None

    now[0] = 1.0
    batch = HeartbeatBatch("agent-a", [Heartbeat(m, 1, 5, 5, 4, 0.0, "") for m in ("m0", "m2", "ghost")])
    decoded = codec.decode(codec.encode(batch))
    assert decoded == batch
    coordinator.handle(now[0], decoded)
    assert (coordinator.members["m0"].last_seen, coordinator.members["m0"].step) == (1.0, 5)
    assert coordinator.members["m2"].last_seen == 0.0  # m2 is not agent-a's member

    coordinator.handle(now[0], HeartbeatBatch("agent-x", [Heartbeat("m0", 1, 6, 6, 5, 0.0, "")]))
    assert coordinator.members["m0"].step == 5  # unknown agent: nothing accepted

    coordinator.declare_dead(now[0], "m1", Detector.OPERATOR, "declared dead by the test")
    now[0] = 2.0
    sends = coordinator.handle(now[0], HeartbeatBatch("agent-a", [Heartbeat("m1", 1, 7, 7, 6, 0.0, "")]))
    assert coordinator.members["m1"].last_seen == 0.0  # fenced: not refreshed
    sent = [send.message for send in sends if send.address == "inproc://m1"]
    assert any(isinstance(message, Fenced) for message in sent)

    reasons = [e.get("reason") for e in (line.fields() for line in events.records) if e["event"] == "rejected"]
    assert reasons.count("not_agents_member") == 2  # m2 and the stranger
    assert "unknown_agent" in reasons and "fenced_peer" in reasons


def test_a_swaps_first_step_is_reported_by_the_new_seat_and_seat_0_only() -> None:
    """Every seat reporting it made one message per member per view change: 131,072 at full scale."""
    result = simulate.simulate(SimConfig(members=256, failures=4, seed=3, aggregate=True))
    assert result["swaps_completed"] + result["failures_on_spares"] == 4, result["violations"]
    reports = result["coordinator_messages"]["Recovered"]
    assert reports <= result["swaps_completed"] + result["views_committed"], result["coordinator_messages"]
