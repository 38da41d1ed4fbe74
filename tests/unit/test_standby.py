"""The standby coordinator's takeover rule and the term rules of the active one, without sockets."""

from __future__ import annotations

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.records import Agent
from deadpool.coordinator.service import Coordinator
from deadpool.coordinator.standby import Standby
from deadpool.coordinator.terms import Terms, takeover_bound
from deadpool.events.log import EventLog
from deadpool.protocol.link import CoordinatorLink, StandDown
from deadpool.protocol.messages import (
    AgentHello,
    CommitView,
    Coordinators,
    Finished,
    Heartbeat,
    HostHeartbeat,
    Join,
    ProcessExited,
    Rejoin,
    Role,
    SilenceQuery,
    SilenceReport,
    StandbyHello,
    StartStandby,
)

ACTIVE, STANDBY = "tcp://10.0.0.10:1", "tcp://10.0.0.11:2"
CONFIG = Config()
BOUND = takeover_bound(CONFIG.failure_timeout)


def _standby(hosts: int = 3) -> Standby:
    standby = Standby(CONFIG, STANDBY, "10.0.0.11:3", ACTIVE, hosts, EventLog(None), started=0.0)
    standby.handle(0.0, Coordinators(1, ACTIVE, STANDBY))
    for h in range(hosts):
        standby.handle(0.0, AgentHello(f"agent{h}", f"host{h}", f"tcp://10.0.0.{10 + h}:9", {}))
    return standby


def _silence(standby: Standby, silent: dict[str, float], at: float) -> list[str]:
    """The active goes silent; the agents answer the query with `silent`; returns who was asked."""
    queries = [s for s in standby.tick(at) if isinstance(s.message, SilenceQuery)]
    for agent, seconds in silent.items():
        standby.handle(at, SilenceReport(agent, queries[0].message.nonce, seconds, 1))  # type: ignore[union-attr]
    standby.tick(at + 0.6)
    return [s.address for s in queries]


def test_the_standby_takes_over_only_when_the_active_is_silent_and_most_hosts_confirm() -> None:
    standby = _standby()
    hello = standby.tick(0.3)
    assert [type(s.message) for s in hello] == [StandbyHello] and hello[0].address == ACTIVE
    assert not [s for s in standby.tick(BOUND - 0.1) if isinstance(s.message, SilenceQuery)], "not yet silent"
    asked = _silence(standby, {"agent1": BOUND, "agent2": 0.4}, at=BOUND + 0.1)
    assert len(asked) == 3 and not standby.took_over, "one host of three confirms: a cut, not a loss"
    asked = _silence(standby, {"agent1": BOUND, "agent2": BOUND}, at=BOUND + 2.0)
    assert standby.took_over and "2 of 3 hosts confirm" in standby.took_over
    coordinator, first = standby.hand_over(CONFIG, 6, 10.0)
    terms = coordinator.terms
    assert terms.term == 2 and terms.address == STANDBY and ACTIVE in terms.superseded
    told = {s.address for s in first}
    assert ACTIVE in told and "tcp://10.0.0.12:9" in told
    assert set(coordinator.agents) == {"agent0", "agent1", "agent2"}
    events: list[dict[str, object]] = []
    coordinator.events.listeners.append(events.append)
    coordinator.handle(10.1, HostHeartbeat("agent1", [], [], [], [], [], [], []))
    assert not [e for e in events if e.get("reason") == "unknown_agent"], "the handed agents are known at once"
    assert coordinator.agents["agent1"].seen == 10.1


def test_a_standby_that_never_heard_the_active_never_takes_over() -> None:
    standby = Standby(CONFIG, STANDBY, "s:1", ACTIVE, 3, EventLog(None), started=0.0)
    assert not [s for s in standby.tick(BOUND * 3) if isinstance(s.message, SilenceQuery)]


def test_takeover_rule() -> None:
    assert not decisions.takeover(BOUND - 1, BOUND, {"a": 99, "b": 99, "c": 99}, 3)[0]
    assert not decisions.takeover(BOUND, BOUND, {"a": BOUND}, 3)[0]
    assert decisions.takeover(BOUND, BOUND, {"a": BOUND / 2, "b": BOUND}, 3)[0]
    assert not decisions.takeover(BOUND, BOUND, {"a": BOUND, "b": BOUND}, 5)[0], "2 of 5 is no majority"


def _active(hosts: int = 3) -> Coordinator:
    terms = Terms(1, ACTIVE, "10.0.0.10:3", hosts, CONFIG.failure_timeout)
    coordinator = Coordinator(CONFIG, 2, "10.0.0.10:3", EventLog(None), terms=terms)
    for h in range(hosts):
        coordinator.handle(0.0, AgentHello(f"agent{h}", f"host{h}", f"tcp://10.0.0.{10 + h}:9", {}))
    return coordinator


def test_the_active_tells_everyone_of_its_standby_and_stamps_its_term() -> None:
    coordinator = _active()
    sends = coordinator.handle(0.1, StandbyHello(STANDBY, 1))
    told = [s for s in sends if isinstance(s.message, Coordinators)]
    assert {s.address for s in told} >= {STANDBY, "tcp://10.0.0.11:9"}
    assert all(s.message == Coordinators(1, ACTIVE, STANDBY, "10.0.0.10:3") for s in told)
    assert coordinator.status(0.2)["standby"] == STANDBY


def test_a_coordinator_that_hears_a_newer_term_stands_down_and_commits_nothing() -> None:
    coordinator = _active()
    coordinator.handle(0.1, Coordinators(2, STANDBY, ""))
    assert coordinator.stood_down is StandDown.SUPERSEDED and coordinator.outcome is not None
    assert not [s for s in coordinator.tick(5.0) if isinstance(s.message, CommitView)]


def test_the_lease_holds_only_while_most_hosts_are_heard_once_there_is_a_standby() -> None:
    coordinator = _active()
    assert coordinator.terms.lease(100.0, coordinator.agents)[0], "no standby yet: no other coordinator could commit"
    coordinator.handle(0.1, StandbyHello(STANDBY, 1))
    assert coordinator.terms.lease(0.5, coordinator.agents)[0]
    coordinator.agents["agent0"].seen = 0.5 + BOUND
    held, why = coordinator.terms.lease(0.5 + BOUND, coordinator.agents)
    assert not held and "only 1 of 3 hosts" in why


def test_a_cut_off_coordinator_stands_down_after_the_view_timeout() -> None:
    coordinator = _active()
    coordinator.handle(0.0, StandbyHello(STANDBY, 1))
    now = 0.0
    while now < CONFIG.view_timeout + 2 * BOUND and coordinator.outcome is None:
        now += 0.1
        coordinator.handle(now, AgentHello("agent0", "host0", "tcp://10.0.0.10:9", {}))  # its own host only
        coordinator.handle(now, StandbyHello(STANDBY, 1))
        coordinator.tick(now)
    assert coordinator.stood_down is StandDown.CUT_OFF, coordinator.outcome


def test_a_coordinator_fails_the_job_only_while_most_hosts_are_heard_more_recently_than_a_failure_timeout() -> None:
    """Its own host cut off, the members on the other hosts go silent exactly when their agents do:
    the silence that fails them is then the hosts' silence too, and it must stand down, not fail the job."""
    for other_hosts_silent, expected in [(0.3, None), (0.8 * CONFIG.failure_timeout, StandDown.CUT_OFF)]:
        coordinator = _active()  # 2 seats, no spare: losing one fails the job
        coordinator.handle(0.0, StandbyHello(STANDBY, 1))
        for seat in range(2):
            coordinator.handle(0.0, Join(f"m{seat}", Role.ACTIVE, seat, 2, 10, "host0", f"tcp://10.0.0.10:{20 + seat}",
                                         f"tcp://10.0.0.10:{30 + seat}"))
        now = 1.0
        for h in range(3):
            coordinator.handle(now - (0 if h == 0 else other_hosts_silent),
                               AgentHello(f"agent{h}", f"host{h}", f"tcp://10.0.0.{10 + h}:9", {}))
        coordinator.handle(now, ProcessExited("agent0", "m1", -9))
        assert coordinator.outcome is not None
        assert coordinator.stood_down is expected, coordinator.outcome
        assert coordinator.terms.lease(now, coordinator.agents)[0], "a commit would still hold the lease"


def test_a_lost_standby_is_replaced_on_another_host() -> None:
    coordinator = _active()
    coordinator.handle(0.0, StandbyHello(STANDBY, 1))
    now, asked = 0.0, []
    while now < 3 * CONFIG.failure_timeout and not asked:
        now += 0.1
        for h in range(3):
            coordinator.handle(now, AgentHello(f"agent{h}", f"host{h}", f"tcp://10.0.0.{10 + h}:9", {}))
        asked = [s for s in coordinator.tick(now) if isinstance(s.message, StartStandby)]
    assert [s.address for s in asked] == ["tcp://10.0.0.12:9"], "not the active's host, not the lost standby's"
    assert coordinator.terms.standby == ""


def test_a_coordinator_paused_longer_than_the_failure_timeout_declares_nobody_dead_for_it() -> None:
    coordinator = _active()
    coordinator.agents["agent0"] = Agent("agent0", "host0", "tcp://10.0.0.10:9", {}, 0.0)
    coordinator.tick(0.1)
    coordinator.tick(3 * CONFIG.failure_timeout)  # SIGSTOPped meanwhile
    assert coordinator.agents["agent0"].seen == 3 * CONFIG.failure_timeout


def test_the_next_term_counts_the_seats_that_finished_while_the_active_was_lost() -> None:
    coordinator = Coordinator(CONFIG, 2, "s:1", EventLog(None), started=0.0, recovering=True,
                              terms=Terms(2, STANDBY, "s:1", 3, CONFIG.failure_timeout))
    coordinator.handed_finished = [Finished(f"m{seat}", 3, seat, 11, "d" * 64) for seat in (0, 1)]
    coordinator.tick(10.0)
    assert coordinator.outcome is not None and coordinator.outcome[0], coordinator.outcome


def test_links_follow_the_newest_term_only() -> None:
    link = CoordinatorLink(ACTIVE)
    assert link.follow(1, ACTIVE, STANDBY) is False and link.standby == STANDBY
    assert link.follow(2, STANDBY, "") is True and link.active == STANDBY
    assert link.stale(1) and not link.stale(0) and not link.stale(2)
    assert link.follow(1, ACTIVE, STANDBY) is False and link.active == STANDBY


def test_a_member_asked_to_rejoin_after_a_takeover_first_hears_who_coordinates_this_term() -> None:
    """A member still following the lost term would send its Join to the dead coordinator: the new
    term's Rejoin comes after a Coordinators notice, which makes it follow (and join) this term."""
    coordinator = Coordinator(CONFIG, 2, "s:1", EventLog(None), started=0.0, recovering=True,
                              terms=Terms(2, STANDBY, "s:1", 3, CONFIG.failure_timeout))
    sends = coordinator.handle(0.5, Heartbeat("m1", 3, 9, 9, 8, 0.0, "tcp://10.0.0.12:7"))
    assert [type(s.message) for s in sends] == [Coordinators, Rejoin]
    assert all(s.address == "tcp://10.0.0.12:7" for s in sends)
    notice = sends[0].message
    assert isinstance(notice, Coordinators) and (notice.term, notice.active) == (2, STANDBY)
