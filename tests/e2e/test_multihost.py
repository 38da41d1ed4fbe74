"""Three hosts, one `deadpool launch` each, and a whole host lost.

The hosts are Linux network namespaces on this machine (see ``netns.py``):
each has its own address on a private bridge (10.77.0.10-12, inside the
namespaces only), so the coordinator, the TCPStore, gloo and the snapshot
streams all run over real TCP between distinct addresses, and "losing a host"
is done for real: every process in it SIGKILLed at once, or its link cut
while its processes live on.

Each host runs ``deadpool launch --nnodes 3 --node-rank I --nproc-per-node 2
--spares 1`` (6 seats, 3 spares, one per host); host 0 also runs the
coordinator on a fixed port that hosts 1 and 2 are given, as ``srun`` would
start them.  Host 2 (seats 4 and 5 and a spare) is the one lost: the spares of
hosts 0 and 1 take its seats, restored from buddies on host 0, and training
ends with the same final state digest as the failure-free run.

Needs root (namespaces); skipped with the reason otherwise.  About 3 minutes on a 2-core machine.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import netns
import pytest

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.terms import takeover_bound

STEPS = 12
BATCH = ("--batch", "4")  # half the demo's batch, in every run (the same digest for all): 6 seats share 2 cores here
FAULT_AFTER_STEP = 4  # host 2 is lost when rank 0 has printed this step
LOST = 2  # the host that is lost
# A paused worker's wait for the view (and a survivor's wait for its buddy's confirmation) is bounded by
# view_timeout; lowered from 60 s so that a cut-off host's workers give up within the test's time.
VIEW_TIMEOUT = 15.0
ENV = {"DEADPOOL_VIEW_TIMEOUT": str(VIEW_TIMEOUT)}
JOB_TIMEOUT = 150.0
HEAD_FAULT_AFTER_STEP = 6  # host 0 (the coordinator's) is lost when rank 0 has printed this step
STOP_S = 3 * takeover_bound(Config().failure_timeout)  # the coordinator SIGSTOPped for 3x the takeover bound


@dataclass
class Run:
    """What one 3-host job did."""

    name: str
    codes: dict[int, int | None]
    outputs: list[str]
    events: list[dict[str, Any]]
    digest: str | None
    started: float
    fault_at: float = 0.0  # wall clock of the kill / the cut
    killed_pids: list[int] = field(default_factory=list)
    cut_host_exits: dict[str, float] = field(default_factory=dict)  # process -> seconds after the cut
    cut_host_left: list[str] = field(default_factory=list)  # still running at the deadline
    leftovers_killed: list[str] = field(default_factory=list)  # killed by the harness at teardown
    digest_hosts: list[int] = field(default_factory=list)  # the hosts whose launcher printed the digest

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def tail(self) -> str:
        return "\n".join(f"---- host{i}\n{out[-2500:]}" for i, out in enumerate(self.outputs))


@pytest.fixture(scope="module")
def namespaces() -> None:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")


def _run(tmp: Path, name: str, fault: str = "", lost: int = LOST, at_step: int = FAULT_AFTER_STEP,
         script_args: tuple[str, ...] = ()) -> Run:
    """One job on three fresh namespace hosts.

    `fault`: '' (none), 'kill' or 'cut' (of host `lost`), 'stop_coordinator' (host 0's coordinator
    process SIGSTOPped for STOP_S, then SIGCONTed) or 'cut_0_1' (only hosts 0 and 1 lose each other).
    """
    with netns.Cluster(3) as cluster:
        job = netns.Job(cluster, tmp, STEPS, env=ENV, script_args=(*BATCH, *script_args))
        run = Run(name, {}, [], [], None, job.started)
        try:
            _, line = job.wait_line(0, r"^deadpool: coordinator ", 90)
            assert f"tcp://{cluster.hosts[0].addr}:{netns.COORDINATOR_PORT}" in line, line
            if fault:
                job.wait_line(0, rf"^\[rank0\] step +{at_step} ", 120)
            if fault:
                run.fault_at = time.time()
                if fault == "kill":
                    run.killed_pids = cluster.kill_host(cluster.hosts[lost])
                elif fault == "cut":
                    cut_pids = {pid: netns.describe(pid) for pid in cluster.pids(cluster.hosts[lost])}
                    cluster.cut_link(cluster.hosts[lost])
                elif fault == "stop_coordinator":
                    (pid,) = cluster.find(cluster.hosts[0], "deadpool.coordinator.main")
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(STOP_S)
                    os.kill(pid, signal.SIGCONT)
                else:
                    cluster.cut_between(cluster.hosts[0], cluster.hosts[1])
            survivors = [h.index for h in cluster.hosts if not (fault in ("kill", "cut") and h.index == lost)]
            run.codes = job.wait(survivors, JOB_TIMEOUT)
            if fault == "cut":
                _watch_cut_host(cluster, run, cut_pids)
            else:
                # Nothing may outlive a launcher that returned: poll the namespaces briefly.
                deadline = time.monotonic() + 5.0
                while any(cluster.pids(h) for h in cluster.hosts) and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            run.outputs = [job.output(h.index) for h in cluster.hosts]
    run.leftovers_killed = cluster.killed_at_teardown
    for pid in run.killed_pids:  # a killed host's agent cannot remove its workers' snapshot slot files
        for path in glob.glob(f"/dev/shm/deadpool-*-{pid}-slot*"):
            os.unlink(path)
    run.events = job.events()
    run.digest = next((d for d in (job.digest(h) for h in range(3)) if d), None)
    run.digest_hosts = [h for h in range(3) if job.digest(h)]
    return run


def _watch_cut_host(cluster: netns.Cluster, run: Run, pids: dict[int, str]) -> None:
    """Record when each process of the cut-off host exits, up to a bound every one of its waits respects."""
    bound = VIEW_TIMEOUT + 10.0  # the agent gives up after the view timeout, then stops its workers
    deadline = run.fault_at + bound
    while time.time() < deadline:
        for pid, what in pids.items():
            if what not in run.cut_host_exits and not netns.alive(pid):
                run.cut_host_exits[what] = round(time.time() - run.fault_at, 1)
        if len(run.cut_host_exits) == len(pids):
            break
        time.sleep(0.2)
    run.cut_host_left = [what for what in pids.values() if what not in run.cut_host_exits]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, namespaces: None) -> Run:
    run = _run(tmp_path_factory.mktemp("baseline"), "baseline")
    assert run.codes == {0: 0, 1: 0, 2: 0}, run.tail()
    assert run.digest, run.tail()
    assert not run.leftovers_killed, f"processes outlived the job: {run.leftovers_killed}"
    return run


@pytest.fixture(scope="module")
def host_killed(tmp_path_factory: pytest.TempPathFactory, namespaces: None) -> Run:
    return _run(tmp_path_factory.mktemp("kill"), "kill", fault="kill")


@pytest.fixture(scope="module")
def link_cut(tmp_path_factory: pytest.TempPathFactory, namespaces: None) -> Run:
    return _run(tmp_path_factory.mktemp("cut"), "cut", fault="cut")


def _host(member: str) -> str:
    return member.split(":", 1)[0]  # member ids are HOST:LABEL:RANDOM (launch --host-name)


@pytest.mark.e2e
def test_three_hosts_train_over_tcp_with_cross_host_buddies(baseline: Run) -> None:
    joined = [e for e in baseline.of("member_joined") if e.get("source_process") == "worker"]
    assert len(joined) == 9, "2 actives and 1 spare on each of the 3 hosts"
    for record in joined:
        index = int(_host(record["member"]).removeprefix("host"))
        address = f"tcp://{netns.SUBNET}.{10 + index}:"
        assert record["control_addr"].startswith(address) and record["bulk_addr"].startswith(address), record
    started = baseline.of("coordinator_started")[0]
    assert started["address"] == f"tcp://{netns.SUBNET}.10:{netns.COORDINATOR_PORT}"
    assert started["store"] == f"{netns.SUBNET}.10:{netns.STORE_PORT}"
    first = baseline.of("view_committed")[0]
    assert [_host(m) for m in first["seats"]] == ["host0", "host0", "host1", "host1", "host2", "host2"]
    last = baseline.of("view_committed")[-1]  # spares may join after the first view: each one commits a view
    assert sorted(_host(m) for m in last["spares"]) == ["host0", "host1", "host2"]
    _assert_copies_on_other_hosts(baseline)
    assert not baseline.of("member_failed")
    assert baseline.of("training_finished")[0]["step"] == STEPS - 1


def _assert_copies_on_other_hosts(run: Run) -> None:
    """Every committed view keeps each seat's snapshot copy on another host than the seat."""
    for view in run.of("view_committed"):
        seats, buddies = view["seats"], view["buddies"]
        for seat, member in enumerate(seats):
            assert _host(seats[buddies[seat]]) != _host(member), f"epoch {view['epoch']}: seat {seat}"


def _assert_host_replaced(run: Run, baseline: Run) -> dict[str, float]:
    """Host 2's seats went to the spares of hosts 0 and 1, restored from buddies; bit-identical end."""
    assert run.codes == {0: 0, 1: 0}, run.tail()
    assert run.digest == baseline.digest, f"a run that lost a host must end bit-identical\n{run.tail()}"
    failed = {e["member"] for e in run.of("member_failed")}
    assert {_host(m) for m in failed} == {f"host{LOST}"}, failed
    assert len(failed) == 3, "both actives and the spare of the lost host"
    swap = [v for v in run.of("view_committed") if v.get("failed_seats")]
    assert len(swap) == 1 and swap[0]["failed_seats"] == [4, 5], swap
    new = swap[0]["seats"]
    assert sorted(_host(new[4]) + _host(new[5])) == sorted("host0host1"), "one spare from each surviving host"
    assert all(":spare" in new[s] for s in (4, 5))
    assert run.of("view_committed")[-1]["spares"] == [], "2 spares seated, the lost host's spare dropped"
    restored = {e["rank"]: e for e in run.of("restored") if e["source"] == "buddy"}
    assert sorted(restored) == [4, 5] and all(r["bytes"] > 1_000_000 for r in restored.values())
    _assert_copies_on_other_hosts(run)
    completed = {e["rank"]: e for e in run.of("swap_completed")}
    assert sorted(completed) == [4, 5]
    assert run.of("training_finished")[0]["step"] == STEPS - 1
    detected = min(e["ts"] for e in run.of("member_failed"))
    recovered = max(e["ts"] for e in completed.values())
    figures = {
        "fault_to_detected_s": round(detected - run.fault_at, 2),
        "fault_to_recovered_s": round(recovered - run.fault_at, 2),
        "coordinator_recovery_s": max(e["recovery_s"] for e in completed.values()),
        "resume_step": swap[0]["resume_step"],
        "run_s": round(time.time() - run.started, 1),
    }
    print(f"\n{run.name}: {figures}; detected by {sorted({e['detected_by'] for e in run.of('member_failed')})}")
    assert figures["fault_to_recovered_s"] < 30, figures
    return figures


@pytest.mark.e2e
def test_whole_host_killed_seats_refilled_from_other_hosts_bit_identical(host_killed: Run, baseline: Run) -> None:
    assert len(host_killed.killed_pids) == 4, "the agent, 2 actives and the spare of the lost host"
    _assert_host_replaced(host_killed, baseline)
    assert not host_killed.leftovers_killed, f"processes outlived the job: {host_killed.leftovers_killed}"


@pytest.mark.e2e
def test_host_link_cut_seats_refilled_bit_identical(link_cut: Run, baseline: Run) -> None:
    _assert_host_replaced(link_cut, baseline)
    assert {e["detected_by"] for e in link_cut.of("member_failed")} == {"heartbeat"}, "no exit report crosses a cut"
    # The cut-off host's actives give up within their bounded waits (they cannot learn they were fenced).
    actives = [what for what in link_cut.cut_host_exits if "train_gpt.py" in what]
    print(f"cut host: exits after the cut (s): {link_cut.cut_host_exits}; still running: {link_cut.cut_host_left}; "
          f"killed by the harness: {link_cut.leftovers_killed}")
    assert len(actives) >= 2, f"the cut-off host's active workers did not exit: {link_cut.cut_host_left}"


@pytest.mark.e2e
def test_cut_off_host_leaves_no_process(link_cut: Run) -> None:
    assert not link_cut.cut_host_left, f"still running {VIEW_TIMEOUT + 10:.0f}s after the cut: {link_cut.cut_host_left}"


def test_spares_of_the_lost_host_are_picked_last() -> None:
    """Pure: a whole-host loss is declared seat by seat; the lost host's spare (silent, not yet declared
    dead) must not be seated, and the two seats go to the spares of the two surviving hosts."""
    hosts = {f"m{i}": f"host{i // 2}" for i in range(6)} | {f"s{h}": f"host{h}" for h in range(3)}
    view, _ = decisions.first_view({i: f"m{i}" for i in range(6)}, 6, ["s2", "s1", "s0"], "x:1", hosts, {})
    assert view is not None and view.buddies == [2, 3, 4, 5, 0, 1]  # ring offset 2: copies on another host
    first, _ = decisions.pick_spares([5], view, ["s2", "s1", "s0"], hosts)  # seat 5's heartbeat expired first
    assert first == {5: "s1"}
    both, _ = decisions.pick_spares([4, 5], view, ["s2", "s1", "s0"], hosts)  # then seat 4's
    assert both == {4: "s1", 5: "s0"}


def test_spare_lost_during_a_swap_keeps_the_pending_restores() -> None:
    """Pure: the lost host's spare is declared dead right after the swap's view commits; the view that drops
    it must still name where seats 4 and 5 restore from, or their buddies drop the copies they need."""
    hosts = {f"m{i}": f"host{i // 2}" for i in range(6)} | {f"s{h}": f"host{h}" for h in range(3)}
    view, _ = decisions.first_view({i: f"m{i}" for i in range(6)}, 6, ["s2", "s1", "s0"], "x:1", hosts, {})
    assert view is not None
    swap = decisions.next_view(view, 2, {4: "s1", 5: "s0"}, ["s2"], 3, hosts, {}, rebuild=True)
    assert swap.restore_from == {4: "m0", 5: "m1"}  # copies on host 0
    pool = decisions.next_view(swap, 3, {}, [], swap.resume_step, hosts, {}, rebuild=False)  # s2 lost
    assert pool.restore_from == swap.restore_from and pool.store_prefix == swap.store_prefix


# -- the head host lost: the standby coordinator on host 1 takes over ------------------------------------

@pytest.fixture(scope="module")
def head_killed(tmp_path_factory: pytest.TempPathFactory, namespaces: None) -> Run:
    return _run(tmp_path_factory.mktemp("head-kill"), "head-kill", "kill", lost=0, at_step=HEAD_FAULT_AFTER_STEP)


@pytest.fixture(scope="module")
def head_cut(tmp_path_factory: pytest.TempPathFactory, namespaces: None) -> Run:
    return _run(tmp_path_factory.mktemp("head-cut"), "head-cut", "cut", lost=0, at_step=HEAD_FAULT_AFTER_STEP)


def _assert_one_view_per_epoch(run: Run) -> None:
    epochs = [v["epoch"] for v in run.of("view_committed")]
    assert len(epochs) == len(set(epochs)), f"an epoch committed twice: {sorted(epochs)}"


def _assert_head_replaced(run: Run, baseline: Run) -> dict[str, float]:
    """Host 1's standby took over (term 2) and refilled host 0's seats from spares of hosts 1 and 2."""
    assert run.codes == {1: 0, 2: 0}, run.tail()
    assert run.digest == baseline.digest, f"a run that lost the head host must end bit-identical\n{run.tail()}"
    assert run.digest_hosts == [1], "the agent of the host with the active coordinator prints the summary"
    (takeover,) = run.of("takeover")
    assert takeover["term"] == 2 and len(takeover["confirmed_by"]) >= 2, takeover
    _assert_one_view_per_epoch(run)
    swap = [v for v in run.of("view_committed") if v.get("failed_seats")]
    assert len(swap) == 1 and swap[0]["failed_seats"] == [0, 1] and swap[0]["term"] == 2, swap
    assert sorted(_host(swap[0]["seats"][s]) for s in (0, 1)) == ["host1", "host2"], swap[0]["seats"]
    restored = {e["rank"]: e for e in run.of("restored") if e["source"] == "buddy"}
    assert sorted(restored) == [0, 1]
    _assert_copies_on_other_hosts(run)
    assert run.of("training_finished")[0]["step"] == STEPS - 1
    completed = run.of("swap_completed")
    figures = {
        "fault_to_takeover_s": round(takeover["ts"] - run.fault_at, 2),
        "fault_to_recovered_s": round(max(e["ts"] for e in completed) - run.fault_at, 2),
        "run_s": round(time.time() - run.started, 1),
    }
    print(f"\n{run.name}: {figures}")
    return figures


@pytest.mark.e2e
def test_head_host_killed_standby_takes_over_bit_identical(head_killed: Run, baseline: Run) -> None:
    assert len(head_killed.killed_pids) == 5, "the agent, the coordinator, 2 actives and the spare of host 0"
    _assert_head_replaced(head_killed, baseline)
    assert not head_killed.leftovers_killed, f"processes outlived the job: {head_killed.leftovers_killed}"


@pytest.mark.e2e
def test_head_host_link_cut_old_coordinator_commits_nothing_after_the_takeover(head_cut: Run, baseline: Run) -> None:
    _assert_head_replaced(head_cut, baseline)
    (takeover,) = head_cut.of("takeover")
    late = [v for v in head_cut.of("view_committed") if v["term"] == 1 and v["ts"] >= takeover["ts"]]
    assert not late, f"the superseded coordinator committed {late}"
    stood = head_cut.of("coordinator_stood_down")
    assert [e["kind"] for e in stood] == ["cut_off"], f"{stood}\n{head_cut.outputs[0][-3000:]}"
    actives = [what for what in head_cut.cut_host_exits if "train_gpt.py" in what]
    assert len(actives) >= 2, f"the cut-off head host's workers did not exit: {head_cut.cut_host_left}"


@pytest.mark.e2e
def test_head_host_coordinator_sigstopped_stands_down_after_sigcont(tmp_path: Path, namespaces: None,
                                                                    baseline: Run) -> None:
    # Slowed steps (a sleep each: the same digest), so that training, which needs no coordinator while nothing
    # fails, outlasts the stop: the old coordinator wakes up with the job still running under the new term.
    run = _run(tmp_path, "coordinator-stopped", "stop_coordinator", at_step=1, script_args=("--step-delay", "1.0"))
    assert run.codes == {0: 0, 1: 0, 2: 0}, run.tail()
    assert run.digest == baseline.digest, run.tail()
    assert run.digest_hosts == [1], f"the new active's host prints the summary\n{run.tail()}"
    (takeover,) = run.of("takeover")
    assert takeover["term"] == 2 and len(takeover["confirmed_by"]) == 3, takeover
    stood = run.of("coordinator_stood_down")
    assert [(e["kind"], e["term"]) for e in stood] == [("superseded", 1)], stood
    assert not [v for v in run.of("view_committed") if v["term"] == 1 and v["ts"] >= takeover["ts"]]
    _assert_one_view_per_epoch(run)
    assert not run.of("member_failed"), "no member was lost: only the coordinator paused"
    stale = [e for e in run.of("rejected") if e.get("reason") == "stale_term"]
    print(f"\ncoordinator stopped {STOP_S:.0f}s: takeover {takeover['ts'] - run.fault_at:.1f}s after the stop; "
          f"{len(stale)} stale-term messages dropped")


@pytest.mark.e2e
def test_head_host_cut_from_host_1_only_no_takeover(tmp_path: Path, namespaces: None, baseline: Run) -> None:
    run = _run(tmp_path, "cut-0-1", "cut_0_1", at_step=HEAD_FAULT_AFTER_STEP)
    assert not run.of("takeover"), "host 2 still hears the active coordinator: no majority for a takeover"
    assert run.codes[0] == 0 and run.codes[2] == 0, run.tail()
    assert run.digest == baseline.digest and run.digest_hosts == [0], run.tail()
    _assert_one_view_per_epoch(run)
    assert {_host(e["member"]) for e in run.of("member_failed")} == {"host1"}
    # The active lost its standby (host 1) and asked the next host that is neither its own nor host 1.
    assert [e["standby"] for e in run.of("standby_lost")] == [run.of("standby_started")[0]["address"]]
    replacement = [e for e in run.of("standby_started") if e["address"].startswith(f"tcp://{netns.SUBNET}.12:")]
    assert replacement, [e["address"] for e in run.of("standby_started")]


# -- planned moves: a preemption notice, a drain, and SIGTERM to every host ---------------------------

MOVE_AFTER_STEP = 4  # the notice or the drain comes once rank 0 has printed this step
DRAIN_SECRET = "7" * 32  # the job's secret, given to `deadpool drain` run on host 0
DRAIN_TIMEOUT = 25.0  # the launcher's default --drain-timeout


Drained = tuple[Run, dict[int, float], subprocess.CompletedProcess[str] | None]


def _run_planned(tmp: Path, name: str, how: str) -> Drained:
    """One 3-host job in which host 1 gets a preemption notice (`how` = 'sigterm': a ``preempt`` chaos spec, which
    its launcher fires by SIGTERM to itself), is drained by an operator ('drain'), or every host gets SIGTERM
    from this harness ('sigterm_all'). Returns the run, each launcher's exit time after the fault, and the
    drain command's result."""
    drain = None
    exited: dict[int, float] = {}
    with netns.Cluster(3) as cluster:
        preempt = ("--chaos", f"preempt:host=1:step={MOVE_AFTER_STEP}") if how == "sigterm" else ()
        job = netns.Job(cluster, tmp, STEPS, env=ENV, script_args=(*BATCH, "--step-delay", "0.2"),
                        secret=DRAIN_SECRET, extra=preempt)
        run = Run(name, {}, [], [], None, job.started)
        try:
            job.wait_line(0, rf"^\[rank0\] step +{MOVE_AFTER_STEP} ", 150)
            run.fault_at = time.time()
            if how == "drain":
                command = [sys.executable, "-m", "deadpool", "drain", "--host", "host1", "--coordinator",
                           f"tcp://{cluster.hosts[0].addr}:{netns.COORDINATOR_PORT}"]
                proc = cluster.popen(cluster.hosts[0], command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "DEADPOOL_SECRET": DRAIN_SECRET}, cwd=netns.REPO)
                out, err = proc.communicate(timeout=60)
                drain = subprocess.CompletedProcess(command, proc.returncode, out, err)
            elif how == "sigterm_all":
                for proc in job.procs:
                    proc.send_signal(signal.SIGTERM)
            for host in range(3):  # in order: host 1 leaves first in every case
                run.codes[host] = job.wait([host], JOB_TIMEOUT)[host]
                exited[host] = time.time() - run.fault_at
        finally:
            run.outputs = [job.output(h.index) for h in cluster.hosts]
    run.leftovers_killed = cluster.killed_at_teardown
    run.events = job.events()
    run.digest = job.digest(0)
    return run, exited, drain


def _assert_host1_moved(run: Run, baseline: Run, trigger: str) -> None:
    """Host 1's seats (2 and 3) moved to the spares of hosts 0 and 2 with no finished step redone."""
    assert run.codes == {0: 0, 1: 0, 2: 0}, run.tail()
    assert run.digest == baseline.digest, f"a drained host must leave the job bit-identical\n{run.tail()}"
    asked = run.of("move_requested")
    assert sorted(e["rank"] for e in asked) == [2, 3] and {e["trigger"] for e in asked} == {trigger}, asked
    assert {_host(e["spare"]) for e in asked} == {"host0", "host2"}, "one spare from each other host"
    assert not run.of("member_failed"), "a planned move is not a failure"
    assert sorted(e["rank"] for e in run.of("seat_left")) == [2, 3]
    for commit in [v for v in run.of("view_committed") if v.get("trigger") == "move"]:
        before = max(e["step"] for e in run.of("step_finished") if e["ts"] < commit["ts"])
        assert commit["resume_step"] == before, f"no finished step is redone: resume {commit['resume_step']}"
    assert sorted(e["rank"] for e in run.of("moved_exit")) == [2, 3]
    final = run.of("view_committed")[-1]
    assert not any(_host(m) == "host1" for m in [*final["seats"], *final["spares"]]), final
    assert "drained" in run.outputs[1] or trigger == "drain", run.outputs[1][-2000:]
    assert run.of("training_finished")[0]["step"] == STEPS - 1


@pytest.mark.e2e
def test_sigterm_to_one_host_drains_it_to_the_other_hosts_spares_bit_identical(
        tmp_path: Path, namespaces: None, baseline: Run) -> None:
    run, exited, _ = _run_planned(tmp_path, "preempt", "sigterm")
    _assert_host1_moved(run, baseline, "preemption")
    assert exited[1] < DRAIN_TIMEOUT, f"host 1's launcher exited {exited[1]:.1f} s after SIGTERM"
    assert "deadpool: host host1 drained" in run.outputs[1], run.outputs[1][-2000:]
    assert [e["spec"] for e in run.of("chaos_injected") if e["action"] == "preempt"] == ["preempt:host=1:step=4"]
    print(f"preemption: host 1 drained and its launcher exited {exited[1]:.1f} s after SIGTERM")


@pytest.mark.e2e
def test_an_operators_drain_moves_the_hosts_seats_and_refuses_what_it_cannot(
        tmp_path: Path, namespaces: None, baseline: Run) -> None:
    run, _, drain = _run_planned(tmp_path, "drain", "drain")
    assert drain is not None and drain.returncode == 0, drain
    assert "rank 2 moves to host" in drain.stdout and "rank 3 moves to host" in drain.stdout, drain.stdout
    _assert_host1_moved(run, baseline, "drain")


@pytest.mark.e2e
def test_sigterm_to_every_host_stops_the_job_without_a_move(tmp_path: Path, namespaces: None) -> None:
    run, _, _ = _run_planned(tmp_path, "stop-all", "sigterm_all")
    assert run.codes == {0: 143, 1: 143, 2: 143}, run.tail()
    assert not run.of("move_requested") and not run.of("seat_left")
    assert "SIGTERM reached every host of the job (3)" in run.tail(), run.tail()
    assert not run.leftovers_killed, f"processes outlived the job: {run.leftovers_killed}"
