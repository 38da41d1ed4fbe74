"""A training script's exception: the one-swap rule, the coordinator's handling, the worker's report and exit."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

import pytest

from deadpool.actors.handoff import Handoff
from deadpool.config import Config
from deadpool.coordinator.decisions import Raised, RaisedError, user_exception
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.errors import CollectiveAborted, JobStopped, MisuseError, WaitTimeout
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import (
    AgentHello,
    Fenced,
    FenceKill,
    Join,
    Message,
    Prepare,
    ProcessExited,
    Role,
    Stop,
    UserException,
)
from deadpool.worker.exit import ExceptionReport, ExitGuard, bounded_traceback, is_user_error
from deadpool.worker.step import StepState

# -- the rule --------------------------------------------------------------------------------------


def test_the_first_exception_swaps_the_member() -> None:
    verdict, why = user_exception([], RaisedError("m1", 1, 5, "ValueError"))
    assert verdict is Raised.SWAP and "replaced once" in why


def test_the_same_exception_at_the_same_step_in_another_process_stops_the_job() -> None:
    earlier = [RaisedError("m1", 1, 5, "ValueError")]
    verdict, why = user_exception(earlier, RaisedError("s0", 1, 5, "ValueError"))
    assert verdict is Raised.STOP and "m1" in why and "step 5" in why


@pytest.mark.parametrize("new", [
    RaisedError("s0", 1, 6, "ValueError"),  # another step
    RaisedError("s0", 1, 5, "KeyError"),  # another type
    RaisedError("m1", 1, 5, "ValueError"),  # the same process again (a repeated report)
])
def test_anything_else_is_swapped(new: RaisedError) -> None:
    assert user_exception([RaisedError("m1", 1, 5, "ValueError")], new)[0] is Raised.SWAP


# -- the coordinator -------------------------------------------------------------------------------


class Job:
    """Two seats and two spares on one agent, on a virtual clock."""

    def __init__(self) -> None:
        self.now = 10.0
        self.events = EventLog(None, clock=lambda: self.now)
        self.events.records = []
        self.coordinator = Coordinator(Config(), 2, "store:1", self.events, started=self.now,
                                       wall_clock=lambda: self.now)
        self.sent: list[Send] = []
        self.handle(AgentHello("agent", "h0", "inproc://agent", {"m0": 1, "m1": 2, "s0": 3, "s1": 4}))
        for name, role, seat in [("s0", Role.SPARE, -1), ("s1", Role.SPARE, -1), ("m0", Role.ACTIVE, 0),
                                 ("m1", Role.ACTIVE, 1)]:
            self.handle(Join(name, role, seat, 2 if role == Role.ACTIVE else 0, 10, "h0", f"inproc://{name}",
                             f"tcp://h0:{seat}"))

    def handle(self, message: Message) -> list[Send]:
        sends = self.coordinator.handle(self.now, message)
        self.sent.extend(sends)
        return sends

    def of(self, event: Event) -> list[dict[str, Any]]:
        assert self.events.records is not None
        return [r for r in (line.fields() for line in self.events.records) if r["event"] == event]


def raised(member: str, step: int = 5, kind: str = "ValueError") -> UserException:
    return UserException(member, 1, 1, step, kind, "bad batch", "Traceback ...\nValueError: bad batch\n")


def test_a_first_report_fences_the_member_and_starts_a_swap() -> None:
    job = Job()
    sends = job.handle(raised("m1"))
    assert Fenced("m1", 1, "exception: raised ValueError at step 5", term=1) in [s.message for s in sends]
    assert any(isinstance(s.message, FenceKill) for s in sends)
    assert any(isinstance(s.message, Prepare) for s in sends)
    [failure] = job.of(Event.MEMBER_FAILED)
    assert failure["detected_by"] == "exception"
    assert [r["verdict"] for r in job.of(Event.USER_EXCEPTION)] == [Raised.SWAP]
    assert job.coordinator.outcome is None
    job.handle(ProcessExited("agent", "m1", 1))  # the exit that follows changes nothing more
    assert len(job.of(Event.MEMBER_FAILED)) == 1


def test_the_replacement_raising_the_same_at_the_same_step_stops_the_job_as_a_user_error() -> None:
    job = Job()
    job.handle(raised("m1"))
    sent = len(job.sent)
    job.handle(raised("s0"))  # the spare chosen for seat 1 replays step 5
    [failed] = job.of(Event.JOB_FAILED)
    assert failed["reason"] == "user_error" and failed["exception"] == "ValueError" and failed["step"] == 5
    assert "ValueError: bad batch" in failed["traceback"] and "relaunch" in failed["detail"]
    assert job.coordinator.outcome is not None and job.coordinator.outcome[0] is False
    stops = [s for s in job.sent[sent:] if isinstance(s.message, Stop)]
    assert {s.address for s in stops} >= {"inproc://m0", "inproc://s0", "inproc://s1", "inproc://agent"}
    # The other spare is never seated: no view but the first and the swap's own.
    assert not any(isinstance(s.message, FenceKill) for s in job.sent[sent:])


def test_a_different_exception_in_the_replacement_is_swapped_again() -> None:
    job = Job()
    job.handle(raised("m1"))
    job.handle(raised("s0", kind="RuntimeError"))
    assert job.coordinator.outcome is None
    assert [r["verdict"] for r in job.of(Event.USER_EXCEPTION)] == [Raised.SWAP, Raised.SWAP]


# -- the worker's side -----------------------------------------------------------------------------


def test_deadpools_own_errors_are_not_reported_but_a_misuse_is() -> None:
    assert is_user_error(ValueError("x")) and is_user_error(MisuseError("x"))
    assert not is_user_error(JobStopped("x")) and not is_user_error(WaitTimeout("x"))
    assert not is_user_error(CollectiveAborted("all-reduce", "peer died")) and not is_user_error(KeyboardInterrupt())


def test_a_long_traceback_keeps_its_end_within_the_bound() -> None:
    try:
        raise ValueError("é" * 3000 + " the bottom")  # 2-byte characters: the bound is in bytes
    except ValueError as err:
        text = bounded_traceback(ValueError, err, err.__traceback__, limit=2048)
    assert len(text.encode()) <= 2048
    assert text.startswith("[... ") and text.endswith("é the bottom\n")


def test_the_report_is_posted_and_the_worker_waits_for_the_coordinators_answer() -> None:
    handoff = Handoff()
    posted: list[Any] = []
    handoff.bind(posted.append)
    state = StepState(rank=1, step=5)
    report = ExceptionReport(handoff, "m1", state, wait_s=5.0)
    threading.Timer(0.1, handoff.deliver, [Fenced("m1", 1, "exception")]).start()
    try:
        raise ValueError("bad batch")
    except ValueError as err:
        report(ValueError, err, err.__traceback__)
    [message] = posted
    assert isinstance(message, UserException)
    assert (message.sender, message.seat, message.step, message.kind) == ("m1", 1, 5, "ValueError")
    assert message.message == "bad batch" and "raise ValueError" in message.traceback
    assert handoff.terminal is not None


class Exited(Exception):
    pass


def test_a_stopped_job_prints_one_line_and_a_script_error_is_reported(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("atexit.register", lambda f: None)
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: traceback.print_exception(value))
    reports: list[BaseException] = []
    guard = ExitGuard()
    guard.arm(lambda: None, lambda kind, value, tb: reports.append(value))
    sys.excepthook(JobStopped, JobStopped("rank 1 raised ValueError twice"), None)
    err = capsys.readouterr().err
    assert err == "deadpool: job stopped: rank 1 raised ValueError twice\n"
    assert reports == [] and guard.status == 1
    boom = ValueError("boom")
    sys.excepthook(ValueError, boom, None)
    assert reports == [boom] and "ValueError: boom" in capsys.readouterr().err


def test_an_active_raising_before_the_first_view_is_named_by_its_seat_not_as_a_spare() -> None:
    events = EventLog(None)
    events.records = []
    coordinator = Coordinator(Config(), 2, "store:1", events)
    coordinator.handle(0.0, AgentHello("agent", "h0", "inproc://agent", {"m0": 1, "m1": 2}))
    coordinator.handle(0.0, Join("m1", Role.ACTIVE, 1, 2, 10, "h0", "inproc://m1", "tcp://h0:1"))
    coordinator.handle(0.0, UserException("m1", 0, -1, -1, "ValueError", "bad", "Traceback ...\n"))
    [report] = [r for r in (line.fields() for line in events.records) if r["event"] == Event.USER_EXCEPTION]
    assert report["rank"] == 1 and "m1 (rank 1)" in report["reason"] and "a spare" not in report["reason"]
    assert coordinator.outcome is not None and not coordinator.outcome[0], "training never started: no swap"


def test_init_process_group_and_init_device_mesh_on_torchruns_environment_are_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import HashStore

    from deadpool.worker.groups.default import refuse_env_rendezvous

    monkeypatch.setattr(dist, "init_process_group", dist.init_process_group)  # restored after the test
    monkeypatch.setattr(device_mesh, "init_process_group", device_mesh.init_process_group)
    refuse_env_rendezvous()
    refuse_env_rendezvous()  # once only
    for call in (lambda: dist.init_process_group("gloo"), lambda: dist.init_process_group("gloo", "env://")):
        with pytest.raises(MisuseError, match="DeadPool makes torch's default group itself"):
            call()
    with pytest.raises(MisuseError, match=r"init_device_mesh\(\) under deadpool launch: make the mesh with rt\."):
        device_mesh.init_device_mesh("cpu", (1,))  # before the loop: torch would make the default group itself
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)  # a group of the script's own
    dist.destroy_process_group()
