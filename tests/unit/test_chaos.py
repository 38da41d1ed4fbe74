"""Chaos specs are data: parsed strictly, each fired once, in the member it names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from deadpool.tools.cli import main  # type: ignore[import-not-found]  (tools/ is installed as deadpool.tools)

from deadpool.actors.handoff import Handoff
from deadpool.agent.closing import summarize
from deadpool.chaos import ChaosPlan, ChaosPoint, host_specs, parse, parse_all, unreachable, unseen
from deadpool.config import WorkerEnv
from deadpool.errors import MisuseError
from deadpool.events.log import EventLog
from deadpool.worker.faults import FaultInjector
from deadpool.worker.step import StepState


def test_parse_forms() -> None:
    assert parse("kill:rank=2:step=20").at == "boundary"
    spec = parse("stop:rank=1:step=35:at=allreduce")
    assert (spec.action, spec.rank, spec.step, spec.at) == ("stop", 1, 35, "allreduce")
    assert parse("kill:spare=0:after=3").after == 3.0
    assert str(parse("kill:rank=2:step=20:at=backward")) == "kill:rank=2:step=20:at=backward"


@pytest.mark.parametrize(
    "bad",
    [
        "explode:rank=1:step=2",
        "kill:rank=1",
        "kill:step=3",
        "kill:rank=1:spare=0:step=1",
        "kill:rank=x:step=1",
        "kill:rank=1:step=1:at=sideways",
        "kill:rank=1:step=1:step=2",
        "kill:spare=0",
        "kill:rank=1:bogus=2:step=1",
        "preempt:host=1",
        "preempt:rank=1:step=3",
        "preempt:host=1:step=3:at=allreduce",
        "kill:host=1:step=3",
        "slow:rank=1:step=8:factor=1",
        "slow:rank=1:step=8:factor=0.5",
        "slow:rank=1:step=8",
        "kill:rank=1:step=8:factor=3",
    ],
)
def test_bad_specs_are_refused_with_an_example(bad: str) -> None:
    with pytest.raises(MisuseError, match="chaos spec"):
        parse(bad)


def test_a_slow_spec_names_a_seat_and_a_factor() -> None:
    spec = parse("slow:rank=1:step=8:factor=3")
    assert (spec.rank, spec.step, spec.factor, str(spec)) == (1, 8, 3.0, "slow:rank=1:step=8:factor=3")
    with pytest.raises(MisuseError, match="factor must be more than 1"):
        parse("slow:rank=1:step=8:factor=1")


def test_a_preempt_spec_names_a_host_and_no_worker_fires_it() -> None:
    spec = parse("preempt:host=1:step=6")
    assert (spec.host, spec.step, str(spec)) == (1, 6, "preempt:host=1:step=6")
    assert not ChaosPlan([spec], 1, -1).pending(), "its host's launcher fires it, not a worker"
    assert host_specs(["preempt:host=1:step=6"], 2, 2, 1) == []
    assert "names host 3, but the job has 3 host(s)" in unreachable(parse("preempt:host=3:step=1"), 6, 1, None, 3)[0]


def test_plan_fires_once_for_the_initial_member_only() -> None:
    specs = parse_all("kill:rank=2:step=5,kill:rank=1:step=5,kill:spare=0:after=1.5")
    plan = ChaosPlan(specs, initial_rank=2, spare_index=-1)
    assert plan.due("boundary", 4) is None
    assert plan.due("boundary", 5) == specs[0]
    assert plan.due("boundary", 5) is None, "a replayed step does not fire again"
    spare_plan = ChaosPlan(specs, initial_rank=-1, spare_index=0)
    assert spare_plan.due("boundary", 5) is None
    assert spare_plan.next_spare_deadline() == 1.5
    assert spare_plan.spare_due(1.0) is None and spare_plan.spare_due(1.6) == specs[2]


def test_the_chaos_command_names_its_actions_plainly(capsys: pytest.CaptureFixture[str]) -> None:
    # A launch-style spec given to `deadpool chaos` is refused with the actions it takes, as typed.
    with pytest.raises(SystemExit) as refused:
        main(["chaos", "kill:rank=1:step=3"])
    stderr = capsys.readouterr().err
    assert refused.value.code == 2
    assert "(choose from 'kill', 'stop', 'cont', 'random')" in stderr, stderr


def test_a_host_reports_the_specs_its_workers_fire() -> None:
    specs = ["kill:rank=1:step=3", "kill:rank=5:step=3", "kill:spare=1:after=2", "stop:rank=2:step=4:at=allreduce"]
    # Host 1 of 2 with 4 ranks each (ranks 4..7) and one spare: rank 5's spec only (spare 1 is on no host here).
    assert host_specs(specs, first_rank=4, nproc=4, spares=1) == ["kill:rank=5:step=3"]
    assert host_specs(specs, first_rank=0, nproc=4, spares=2) == [
        "kill:rank=1:step=3", "kill:spare=1:after=2.0", "stop:rank=2:step=4:at=allreduce"]


def test_the_closing_lines_name_a_spec_that_never_fired(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    fired = {"event": "chaos_injected", "ts": 1.0, "member": "m2", "rank": 2, "action": "kill",
             "spec": "kill:rank=2:step=20", "at": "boundary"}
    operator = {"event": "chaos_injected", "ts": 2.0, "member": "coordinator", "action": "stop", "via": "operator"}
    events.write_text("".join(json.dumps(record) + "\n" for record in (fired, operator)))
    lines = summarize(str(events), ["kill:rank=2:step=20", "kill:rank=1:step=11:at=recovery"])
    assert [line for line in lines if "chaos" in line] == [
        "  chaos: kill:rank=1:step=11:at=recovery never fired: its member did not reach that point of that step, "
        "or was not running then"]
    assert not [line for line in summarize(str(events), ["kill:rank=2:step=20"]) if "chaos" in line]


def test_a_spec_whose_point_the_first_step_did_not_pass_is_unseen() -> None:
    specs = parse_all("kill:rank=1:step=3:at=reducescatter,kill:rank=1:step=4:at=backward,kill:rank=1:step=5,"
                      "kill:rank=1:step=6:at=recovery,kill:rank=1:step=0:at=allgather,kill:spare=0:after=1")
    seen = {ChaosPoint.BOUNDARY, ChaosPoint.BACKWARD, ChaosPoint.ALLREDUCE}  # an rt.ddp step
    # The boundary is always passed and recovery is no step's point; a spec of an earlier step is past.
    assert unseen(specs, seen, step=1) == [specs[0]]
    assert unseen(specs, seen, step=0) == [specs[0], specs[4]]


def injector(specs: str, rank: int = 1) -> tuple[FaultInjector, EventLog]:
    env = dataclasses.replace(WorkerEnv.from_env({"DEADPOOL_COORDINATOR": "tcp://127.0.0.1:1",
                                                  "DEADPOOL_MEMBER_ID": "m1", "RANK": str(rank)}),
                              chaos=tuple(parse_all(specs)))
    events = EventLog(None, member="m1", source="worker")
    events.records = []
    state = StepState(rank=rank, step=0)
    return FaultInjector(env, state, Handoff(), events, partition=type("Switch", (), {"cut": False})()), events


def test_the_first_finished_step_warns_of_a_spec_whose_point_it_did_not_pass(
        capsys: pytest.CaptureFixture[str]) -> None:
    faults, events = injector("kill:rank=1:step=3:at=reducescatter,kill:rank=1:step=3:at=allreduce")
    for point in (ChaosPoint.BOUNDARY, ChaosPoint.BACKWARD, ChaosPoint.ALLREDUCE):
        faults.point(point)
    faults.first_step_done(0)
    assert events.records is not None
    [record] = (line.fields() for line in events.records)
    assert (record["event"], record["spec"], record["at"], record["seen"], record["step"]) == (
        "chaos_point_unseen", "kill:rank=1:step=3:at=reducescatter", "reducescatter",
        ["boundary", "backward", "allreduce"], 0)
    err = capsys.readouterr().err
    assert "chaos spec kill:rank=1:step=3:at=reducescatter will likely never fire" in err
    assert "passed no reducescatter point" in err and "exits with status 4" in err
    faults.first_step_done(1)  # once: later steps say nothing
    assert len(events.records) == 1


def test_an_unarmed_process_notes_nothing() -> None:
    faults, events = injector("kill:rank=0:step=3:at=reducescatter", rank=1)  # another rank's spec
    assert not faults.armed
    faults.point(ChaosPoint.BOUNDARY)
    faults.first_step_done(0)
    assert events.records == []


@pytest.mark.parametrize("bad, says", [
    ("corrupt:rank=1:step=3", "corrupt takes"),
    ("corrupt:rank=1:step=3:what=weights", "what= must be one of param, grad, optim"),
    ("corrupt:rank=1:step=3:what=param:bit=32", "bit= must be 0..31"),
    ("corrupt:rank=1:step=3:what=param:every=2", "every= takes 1"),
    ("corrupt:rank=1:step=3:what=param:at=allreduce", "corrupt takes"),
    ("kill:rank=1:step=3:what=param", "for corrupt only"),
])
def test_a_corrupt_spec_naming_what_does_not_exist_is_refused(bad: str, says: str) -> None:
    with pytest.raises(MisuseError, match=says):
        parse(bad)


def test_a_corrupt_spec_fires_at_its_step_or_at_every_step_from_it() -> None:
    once, every = parse_all("corrupt:rank=1:step=3:what=param,corrupt:rank=1:step=5:what=grad:bit=20:every=1")
    assert str(once) == "corrupt:rank=1:step=3:what=param:bit=16" and every.every and every.bit == 20
    plan = ChaosPlan([once, every], initial_rank=1, spare_index=-1)
    assert plan.due("boundary", 3) is None, "a corrupt spec fires at its tensor, not at a point of the step"
    assert plan.corrupt_due("param", 2) is None and plan.corrupt_due("param", 3) == once
    assert plan.corrupt_due("param", 3) is None, "once"
    assert [plan.corrupt_due("grad", step) for step in (4, 5, 6)] == [None, every, every]
    assert not plan.pending()
    assert "names rank 4" in unreachable(parse("corrupt:rank=4:step=1:what=optim"), 4, 1, None)[0]
