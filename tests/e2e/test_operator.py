"""Operating a live job: ``deadpool status``, ``deadpool chaos``, ``deadpool events --plot``, metrics, progress.

The end-to-end tests share one real job (``deadpool launch`` of the GPT demo,
2 ranks + 2 spares, slowed with ``--step-delay``) and run in file order
against it: status, stop/cont, a kill at a step, a seeded random kill, the
metrics endpoint, then the job's end and its plot.  Commands run as real
subprocesses where the entry point itself is under test and in-process
(``deadpool.tools.cli.main``) elsewhere, which skips a torch import per call.  A
torchrun-style script then runs under ``deadpool launch`` with a kill and
ends bit-identical to its failure-free run.  The rest are pure logic.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deadpool.tools import request
from deadpool.tools.chaos import RandomPick, pick_random
from deadpool.tools.cli import main as cli_main
from event_lines import line, typed
from launch_util import DEMO, REPO, LaunchResult, assert_no_survivors, read_events, wait_for

from deadpool.agent import jobfile
from deadpool.agent.heapenv import STEADY_HEAP_ENV, huge_pages_env, steady_heap_env, worker_heap_env
from deadpool.agent.progress import EventTail, JobProgress
from deadpool.coordinator.metrics import CoordinatorMetrics

STEPS = 50
STEP_DELAY = 0.3
TORCHRUN_SCRIPT = REPO / "tests" / "torchrun_style.py"

Events = list[dict[str, Any]]


# -- the live job ---------------------------------------------------------------------------------


class LiveJob:
    """One running ``deadpool launch`` and what the tests learned about it."""

    def __init__(self, proc: subprocess.Popen[bytes], events: Path, log: Path) -> None:
        self.proc = proc
        self.events_path = events
        self.log = log
        self.watch: subprocess.Popen[bytes] | None = None  # `deadpool status --watch`, running beside the job
        self.watch_log = log.with_name("watch.jsonl")

    def events(self) -> Events:
        return read_events(self.events_path)

    def of(self, kind: str) -> Events:
        return [e for e in self.events() if e.get("event") == kind]

    def wait_for(self, predicate: Callable[[Events], bool], timeout: float, what: str) -> Events:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if predicate(events):
                return events
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log.read_text()[-3000:] if self.log.exists() else ""
        raise AssertionError(f"{what}: not within {timeout}s (launch rc={self.proc.poll()}); output tail:\n{tail}")

    def worker_pids(self) -> set[int]:
        return {int(e["pid"]) for e in self.of("member_joined") if e.get("source_process") == "worker"}


def steps_done(events: Events) -> int:
    return max((e["step"] for e in events if e.get("event") == "step_finished"), default=-1)


def swaps(events: Events) -> Events:
    return [e for e in events if e.get("event") == "swap_completed"]


def status_now() -> dict[str, Any]:
    import asyncio

    return asyncio.run(request.fetch_status(jobfile.resolve()))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run a ``deadpool`` command in this process (its exit status, stdout, stderr)."""
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def deadpool_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "deadpool", *argv]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveJob]:
    home = tmp_path_factory.mktemp("deadpool-home")
    events, log = home / "events.jsonl", home / "launch.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEADPOOL_HOME", str(home))  # this job's file, apart from any other job on the machine
        mp.delenv("DEADPOOL_SECRET", raising=False)  # the launcher makes a secret; tools read it from the job file
        with log.open("wb") as out:
            proc = subprocess.Popen(
                deadpool_command("launch", "--nproc", "2", "--spares", "2", "--failure-timeout", "10",
                                 "--metrics-port", "0", "--events", str(events), str(DEMO), "--steps", str(STEPS),
                                 "--step-delay", str(STEP_DELAY)),
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            )
        live = LiveJob(proc, events, log)
        try:
            live.wait_for(lambda ev: steps_done(ev) >= 1, 150, "first steps")
            with live.watch_log.open("wb") as out:
                live.watch = subprocess.Popen(deadpool_command("status", "--watch", "0.5", "--json"), stdout=out,
                                              stderr=subprocess.DEVNULL, cwd=REPO)
            yield live
        finally:
            # Normally the job has ended here; otherwise end what this fixture started, and only that.
            pids = live.worker_pids()
            watch = live.watch
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its coordinator
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            proc.wait(10)
            if watch is not None and watch.poll() is None:
                watch.kill()
                watch.wait(10)


# -- end to end, in file order against the one job ------------------------------------------------


@pytest.mark.e2e
def test_status_json_shows_seats_spares_and_steps(job: LiveJob) -> None:
    proc = subprocess.run(deadpool_command("status", "--json"), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["world_size"] == 2 and status["epoch"] >= 1 and status["outcome"] is None
    seats = status["seats"]
    assert [s["rank"] for s in seats] == [0, 1]
    pids = job.worker_pids()
    for seat, other in ((seats[0], seats[1]), (seats[1], seats[0])):
        assert seat["state"] == "active" and seat["pid"] in pids and seat["host"]
        assert seat["step"] >= 0 and seat["snapshot_step"] >= 0
        assert seat["copy_on"] == other["member"], "the buddy copy lives on the ring neighbour"
        assert 0 <= seat["heartbeat_age_s"] < 5
    assert len(status["spares"]) == 2 and all(s["pid"] in pids for s in status["spares"])
    assert any(e["event"] == "view_committed" for e in status["recent_events"])


@pytest.mark.e2e
def test_workers_run_with_a_steady_heap(job: LiveJob) -> None:
    """Every worker (actives and spares) gets the launcher's glibc settings, or the ones this shell set."""
    names = (*STEADY_HEAP_ENV, "GLIBC_TUNABLES")
    expected = {name: os.environ.get(name) for name in names} | worker_heap_env(dict(os.environ))
    assert "hugetlb=1" in str(expected["GLIBC_TUNABLES"]) or "GLIBC_TUNABLES" in os.environ
    pids = job.worker_pids()
    assert len(pids) == 4
    for pid in pids:
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert {name: environ.get(name) for name in names} == expected, pid


@pytest.mark.e2e
def test_status_table_and_wrong_secret(job: LiveJob, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = cli(capsys, "status")
    assert code == 0
    status = status_now()
    for seat in status["seats"]:
        assert seat["member"] in out
    assert "spares (2)" in out and "buddy copy" in out and "recent events" in out

    monkeypatch.setenv("DEADPOOL_SECRET", "not-the-job-secret")
    code, _, err = cli(capsys, "status", "--timeout", "1")
    assert code == 1 and "secret" in err
    job.wait_for(lambda ev: any(e["event"] == "rejected" and e.get("reason") == "bad_mac" for e in ev), 10,
                 "the coordinator logs the unauthenticated request")


@pytest.mark.e2e
def test_tools_given_the_address_find_the_secret_in_the_job_file(job: LiveJob) -> None:
    # The address from the events file, no secret given: the job file of that address on this host has it.
    address = job.of("coordinator_started")[0]["address"]
    proc = subprocess.run(deadpool_command("status", "--coordinator", address, "--json"), capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["world_size"] == 2


@pytest.mark.e2e
def test_chaos_stop_then_cont_by_member_and_rank(job: LiveJob, capsys: pytest.CaptureFixture[str]) -> None:
    member = status_now()["seats"][0]["member"]
    code, out, _ = cli(capsys, "chaos", "stop", "--member", member)
    assert code == 0 and f"stop sent to {member}" in out
    deadline = time.monotonic() + 8  # failure_timeout is 10 s: continue it long before that
    while status_now()["seats"][0]["heartbeat_age_s"] < 1.5:
        assert time.monotonic() < deadline, "a stopped member keeps sending heartbeats"
        time.sleep(0.2)
    code, out, _ = cli(capsys, "status")
    assert "silent" in out, out
    address = job.of("coordinator_started")[0]["address"]  # by address: the secret comes from the job file
    code, out, _ = cli(capsys, "chaos", "cont", "--rank", "0", "--after", "0.2", "--coordinator", address)
    assert code == 0 and f"cont sent to {member}" in out
    before = steps_done(job.events())
    job.wait_for(lambda ev: steps_done(ev) >= before + 2, 60, "training continues after SIGCONT")
    chaos = [(e["action"], e["target_member"]) for e in job.of("chaos_injected") if e.get("via") == "operator"]
    assert chaos == [("stop", member), ("cont", member)]
    assert not job.of("member_failed"), "a member continued within failure_timeout is not declared dead"


@pytest.mark.e2e
def test_chaos_kill_at_a_step_swaps_the_seat(job: LiveJob, capsys: pytest.CaptureFixture[str]) -> None:
    before = status_now()
    old = before["seats"][1]["member"]
    at_step = steps_done(job.events()) + 3
    code, out, err = cli(capsys, "chaos", "kill", "--rank", "1", "--at-step", str(at_step))
    assert code == 0, err
    assert f"armed: kill {old} when it finishes step {at_step}" in out, out
    events = job.wait_for(lambda ev: len(swaps(ev)) >= 1, 90, "the spare takes seat 1")
    swap = swaps(events)[0]
    assert swap["rank"] == 1 and swap["old_member"] == old and swap["recovery_s"] > 0
    injected = [e for e in events if e["event"] == "chaos_injected" and e.get("action") == "kill"]
    assert injected[0]["target_member"] == old and injected[0]["at_step"] == at_step
    after = status_now()
    assert after["seats"][1]["member"] == swap["new_member"] != old
    assert after["epoch"] > before["epoch"] and len(after["spares"]) == 1 and old in after["fenced"]


@pytest.mark.e2e
def test_chaos_random_is_seeded_and_stops_without_spares(job: LiveJob, capsys: pytest.CaptureFixture[str]) -> None:
    seed = 11
    expected_rank = random.Random(seed).choice([0, 1])  # pick_random draws the seat first, over sorted ranks
    code, out, _ = cli(capsys, "chaos", "random", "--seed", str(seed), "--failures", "1", "--interval", "0.5",
                       "--actions", "kill")
    assert code == 0, out
    assert f"[1/1] seed {seed}: kill rank {expected_rank} " in out
    events = job.wait_for(lambda ev: len(swaps(ev)) >= 2, 90, "the second spare takes the seat")
    assert swaps(events)[1]["rank"] == expected_rank
    # No spare is left: a soak run waits (bounded) for one rather than ending the job.
    code, _, err = cli(capsys, "chaos", "random", "--seed", "1", "--failures", "1", "--interval", "0.1",
                       "--settle-timeout", "1")
    assert code == 1 and "no spare left" in err


@pytest.mark.e2e
def test_metrics_endpoint_serves_the_job(job: LiveJob) -> None:
    url = job.of("coordinator_started")[0]["metrics"]
    assert url.startswith("http://127.0.0.1:")
    deadline = time.monotonic() + 10
    while True:  # gauges refresh every second
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        if "deadpool_spares 0.0" in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for name in ("deadpool_members", "deadpool_spares", "deadpool_epoch", "deadpool_swaps_total",
                 "deadpool_detection_seconds_bucket", "deadpool_recovery_seconds_bucket",
                 "deadpool_snapshot_stall_p99_seconds", "deadpool_heartbeat_age_seconds", "deadpool_step"):
        assert name in text, name
    assert "deadpool_members 2.0" in text and "deadpool_spares 0.0" in text
    assert "deadpool_swaps_total 2.0" in text and "deadpool_recovery_seconds_count 2.0" in text
    assert 'deadpool_chaos_injected_total{action="kill"} 2.0' in text
    failures = re.findall(r'^deadpool_failures_total\{detected_by="\w+"\} ([\d.]+)$', text, re.MULTILINE)
    assert sum(float(n) for n in failures) == 2.0, failures
    assert "deadpool_detection_seconds_count 2.0" in text, "operator kills are timed from the signal"


@pytest.mark.e2e
def test_job_finishes_with_progress_and_plots(job: LiveJob, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    job.proc.wait(timeout=180)
    output = job.log.read_text()
    result = LaunchResult(job.proc.returncode, output, job.events(), 0.0)
    assert result.returncode == 0, output[-3000:]
    assert result.digest and len(result.of("swap_completed")) == 2
    assert_no_survivors(result)
    progress_line = r"^deadpool: step \d+ \| [\d,]+ tok/s \| spares \d \| view epoch \d+"
    assert re.search(progress_line, output, re.MULTILINE), output
    assert "Prometheus metrics at http://127.0.0.1:" in output

    assert job.watch is not None
    job.watch.wait(timeout=30)  # it ends by itself with the job
    documents = [json.loads(line) for line in job.watch_log.read_text().splitlines() if line.strip()]
    assert len(documents) >= 2 and documents[-1]["epoch"] >= documents[0]["epoch"]

    png = tmp_path / "plot.png"
    code, out, _ = cli(capsys, "events", str(job.events_path), "--plot", str(png))
    assert code == 0 and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "swaps" in out and "chaos injected" in out


# -- a torchrun-style script under deadpool launch ------------------------------------------------


@pytest.mark.e2e
def test_torchrun_style_script_hot_swaps_bit_identically(tmp_path: Path) -> None:
    # Both runs at once (two jobs, two coordinators, no shared state): half the wall time.
    runs = {}
    for name, chaos in (("chaos", ("--chaos", "kill:rank=1:step=4")), ("plain", ())):
        events, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(deadpool_command("launch", "--no-progress", "--nproc", "2", "--spares", "1",
                                                     "--events", str(events), *chaos, str(TORCHRUN_SCRIPT),
                                                     "--steps", "10"),
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "DEADPOOL_HOME": str(tmp_path / name)})
        runs[name] = (proc, events, log)
    results = {}
    for name, (proc, events, log) in runs.items():
        proc.wait(timeout=180)
        result = LaunchResult(proc.returncode, log.read_text(), read_events(events), 0.0)
        assert_no_survivors(result)
        assert result.returncode == 0 and result.digest, result.output[-3000:]
        results[name] = result
    chaos_run = results["chaos"]
    assert len(chaos_run.of("swap_completed")) == 1
    assert re.search(r"\[rank0\] env: RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER=127\.0\.0\.1:\d+", chaos_run.output)
    assert "[spare0] env: RANK=-1 WORLD_SIZE=2 LOCAL_RANK=2" in chaos_run.output
    assert results["plain"].digest == chaos_run.digest, "a run with a swap ends bit-identical to a failure-free run"


def test_sigterm_to_the_launcher_stops_every_process_and_removes_their_files(tmp_path: Path) -> None:
    """What SLURM and Kubernetes send to stop a job: workers, spare and coordinator end, nothing is left."""
    shm = tmp_path / "shm"
    shm.mkdir()
    events, log = tmp_path / "events.jsonl", tmp_path / "launch.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(deadpool_command("launch", "--no-progress", "--nproc", "2", "--spares", "1",
                                                 "--shm-dir", str(shm), "--events", str(events), str(DEMO),
                                                 "--steps", "500"),
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "DEADPOOL_HOME": str(tmp_path / "home")})
    try:
        wait_for(events, lambda evs: sum(e["event"] == "step_finished" for e in evs) >= 4, timeout=120)
        assert list(shm.iterdir()), "the seats keep their snapshot slots in the shared-memory directory"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = read_events(events)
    result = LaunchResult(proc.returncode, log.read_text(), records, 0.0)
    assert result.returncode == 128 + signal.SIGTERM, result.output[-3000:]
    assert "SIGTERM: stopping this host's workers" in result.output
    assert_no_survivors(result)
    coordinator = [e["pid"] for e in records if e["event"] == "coordinator_started" and "pid" in e]
    assert all(not os.path.exists(f"/proc/{pid}") for pid in coordinator)
    assert not list(shm.iterdir()), "no slot file is left behind"


# -- pure logic: command-line misuse, chaos picks, progress, metrics -------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["chaos", "kill"], "got neither"),
        (["chaos", "stop", "--rank", "1", "--member", "m"], "not both"),
        (["chaos", "kill", "--rank", "-3"], "--rank must be >= 0"),
        (["chaos", "kill", "--rank", "0", "--at-step", "3", "--after", "1"], "not both"),
        (["chaos", "random", "--seed", "1", "--failures", "2", "--interval", "1", "--actions", "kill,explode"],
         "--actions"),
        (["chaos", "random", "--seed", "1", "--failures", "0", "--interval", "1"], "--failures"),
        (["status", "--watch", "0"], "--watch"),
        (["status", "--timeout", "0"], "--timeout"),
        (["status"], "no running job found"),
        (["launch", "--metrics-port", "70000", str(DEMO)], "--metrics-port"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DEADPOOL_HOME", str(tmp_path))  # no job here
    code, _, err = cli(capsys, *argv)
    assert code == 2 and message in err, err


def _status(spares: int = 1, steps: tuple[int, ...] = (5, 5), **extra: Any) -> dict[str, Any]:
    seats = [{"rank": r, "member": f"m{r}", "state": "active", "step": s} for r, s in enumerate(steps)]
    return {"seats": seats, "spares": [{"member": f"s{i}"} for i in range(spares)], "round": None, "outcome": None,
            **extra}


def test_a_users_malloc_setting_wins_over_the_steady_heap() -> None:
    assert steady_heap_env({}) == STEADY_HEAP_ENV
    assert steady_heap_env({"MALLOC_TRIM_THRESHOLD_": "0"}) == {}, "the user's choice is kept, not mixed with ours"
    assert steady_heap_env({"MALLOC_MMAP_THRESHOLD_": "65536"}) == {}


def test_workers_ask_for_huge_pages_unless_the_user_set_that_tunable() -> None:
    assert huge_pages_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == \
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}, "the user's other tunables are kept"
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}, "the user's choice wins"
    assert worker_heap_env({"MALLOC_TRIM_THRESHOLD_": "0"}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_random_picks_are_seeded_and_wait_for_a_ready_job() -> None:
    picks = [pick_random(random.Random(7), _status(steps=(5, 5, 5, 5)), ["kill", "stop"]) for _ in range(3)]
    assert picks[0] == picks[1] == picks[2] and isinstance(picks[0], RandomPick)
    rng = random.Random(3)
    sequence = [pick_random(rng, _status(steps=(5, 5, 5, 5)), ["kill", "stop"]) for _ in range(20)]
    rng = random.Random(3)
    assert sequence == [pick_random(rng, _status(steps=(5, 5, 5, 5)), ["kill", "stop"]) for _ in range(20)]
    assert {p.rank for p in sequence if isinstance(p, RandomPick)} == {0, 1, 2, 3}
    assert "no spare" in str(pick_random(rng, _status(spares=0), ["kill"]))
    assert "view change" in str(pick_random(rng, _status(round={"epoch": 3}), ["kill"]))
    assert "first step" in str(pick_random(rng, _status(steps=(-1, -1)), ["kill"]))
    assert "ended" in str(pick_random(rng, _status(outcome={"ok": True, "reason": "done"}), ["kill"]))


def test_progress_line_follows_the_events(tmp_path: Path) -> None:
    progress = JobProgress(seats=2, spares_started=1)
    progress.feed(typed({"event": "member_joined", "source_process": "worker", "role": "active"}))
    assert progress.line().startswith("starting: 1/2 ranks and 0 spares joined")
    progress.feed(typed({"event": "view_committed", "epoch": 1, "seats": ["m0", "m1"], "spares": ["s"]}))
    for step in range(4):
        for rank in range(2):
            progress.feed(typed({"event": "step_finished", "step": step, "rank": rank, "ts": 100.0 + step,
                                 "tokens": 512}))
    assert progress.line() == "step 3 | 1,024 tok/s | spares 1 | view epoch 1"
    progress.feed(typed({"event": "member_failed", "member": "m1", "rank": 1}))
    assert progress.line().endswith("1 failure, 0 swaps | recovering")
    progress.feed(typed({"event": "view_committed", "epoch": 2, "seats": ["m0", "s"], "spares": []}))
    progress.feed(typed({"event": "swap_completed", "recovery_s": 0.93}))
    assert "spares 0 | view epoch 2 | 1 failure, 1 swap (last 0.93 s)" in progress.line()
    progress.feed(typed({"event": "training_finished", "step": 3}))
    assert progress.line().startswith("finished at step 3")

    path = tmp_path / "events.jsonl"
    tail = EventTail(str(path))
    assert tail.read() == []  # not created yet
    a, b, c = (json.dumps(line("paused", ts=float(n))) for n in range(3))
    path.write_text(f"{a}\n{b[:10]}")
    assert [r.ts for r in tail.read()] == [0.0]
    with path.open("a") as handle:
        handle.write(f'{b[10:]}\nnot json\n{c}\n')  # a line off the schema is logged and skipped: decoration
    assert [r.ts for r in tail.read()] == [1.0, 2.0]


def test_event_file_readers_leave_a_half_written_last_line(tmp_path: Path) -> None:
    # A reader can see half of a writer's single write(): CI once failed on exactly that.
    from deadpool.events import schema

    a, b = json.dumps(line("paused", ts=1.0)), json.dumps(line("step_finished", ts=2.0, loss=5.7, tokens=512))
    path = tmp_path / "events.jsonl"
    path.write_text(f"{a}\n{b[:-12]}")
    assert [r.ts for r in schema.read(path)] == [1.0]
    assert [r["event"] for r in read_events(path)] == ["paused"]
    with path.open("a") as handle:
        handle.write(f"{b[-12:]}\n")
    assert [r["event"] for r in read_events(path)] == ["paused", "step_finished"]
    assert [r.ts for r in schema.read(path)] == [1.0, 2.0]
    path.write_text(f"{a}\nnot json\n{b}\n")  # a whole line that is no event is an error that names it
    with pytest.raises(schema.SchemaError, match=r"events\.jsonl:2: not a JSON event line"):
        schema.read(path)


def test_metrics_count_events_and_refresh_gauges() -> None:
    from prometheus_client import generate_latest

    metrics = CoordinatorMetrics()
    metrics.on_event(typed({"event": "member_failed", "detected_by": "exit", "detection_s": 0.02}))
    metrics.on_event(typed({"event": "member_failed", "detected_by": "heartbeat", "detection_s": None}))
    metrics.on_event(typed({"event": "swap_completed", "recovery_s": 0.9}))
    metrics.on_event(typed({"event": "view_committed", "epoch": 3, "spares": ["a"]}))
    metrics.on_event(typed({"event": "swap_completed", "recovery_s": -1.0}))  # counted, not observed
    metrics.refresh(_status(steps=(7, 6)) | {"epoch": 3, "world_size": 2, "fenced": ["x"]})
    text = generate_latest(metrics.registry).decode()
    assert "deadpool_swaps_total 2.0" in text and "deadpool_recovery_seconds_count 1.0" in text
    assert "deadpool_detection_seconds_count 1.0" in text and 'deadpool_failures_total{detected_by="exit"} 1.0' in text
    assert "deadpool_epoch 3.0" in text and "deadpool_fenced_members 1.0" in text
    assert 'deadpool_step{rank="1"} 6.0' in text
    metrics.refresh(_status(steps=(8,)) | {"epoch": 4, "world_size": 1})
    assert 'deadpool_step{rank="1"}' not in generate_latest(metrics.registry).decode(), "a seat that left is dropped"


def test_ctrl_c_twice_stops_every_process_without_a_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the launcher and its coordinator (the workers run in sessions of their own);
    pressed again while the workers stop, it must neither cut that short (orphans) nor print tracebacks."""
    events, log = tmp_path / "events.jsonl", tmp_path / "launch.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(deadpool_command("launch", "--no-progress", "--nproc", "2", "--spares", "1",
                                                 "--events", str(events), str(REPO / "tests" / "fixtures" /
                                                                              "tiny_train.py"), "--steps", "100000"),
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "DEADPOOL_HOME": str(tmp_path / "home")})
    try:
        wait_for(events, lambda evs: sum(e["event"] == "step_finished" for e in evs) >= 4, timeout=120)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = LaunchResult(proc.returncode, log.read_text(), read_events(events), 0.0)
    assert result.returncode == 128 + signal.SIGINT, result.output[-3000:]
    assert "SIGINT: stopping this host's workers" in result.output
    assert "Traceback" not in result.output, result.output[-3000:]
    assert_no_survivors(result)
