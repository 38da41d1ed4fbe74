"""A launch's verdict beyond "training finished": a chaos spec that never fired, a final state not guaranteed.

Pure functions of the events file's facts: which specs never fired and why (what their member reached),
the closing lines, and the exit status (4 for a spec that never fired, 5 under --strict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from event_lines import line, typed

from deadpool.agent import closing, verdict
from deadpool.events import summary

DDP_SEEN = ("boundary", "backward", "allreduce")  # what an rt.ddp step passes


def facts(records: list[dict[str, Any]]) -> list[summary.Fact | None]:
    return [summary.parse(typed(record)) for record in records]


def steps(member: str, rank: int, last: int) -> list[dict[str, Any]]:
    return [{"event": "step_finished", "member": member, "rank": rank, "step": step, "epoch": 1}
            for step in range(last + 1)]


def test_a_spec_whose_point_no_step_passes_says_what_the_member_did_pass() -> None:
    spec = "kill:rank=1:step=3:at=reducescatter"
    records = [*steps("m1", 1, 9), {"event": "chaos_point_unseen", "member": "m1", "rank": 1, "step": 0,
                                    "spec": spec, "at": "reducescatter", "seen": list(DDP_SEEN)}]
    [finding] = verdict.not_fired([spec], {spec: "m1"}, verdict.trails_of(facts(records), ["m1"]))
    assert (finding.spec, finding.at, finding.member, finding.rank, finding.last_step) == (
        spec, "reducescatter", "m1", 1, 9)
    assert finding.seen == DDP_SEEN and finding.ended == verdict.Ended.RAN
    assert "finished step 3 (and steps up to 9) without passing a reducescatter point" in finding.why
    assert "its first step passed boundary, backward, allreduce" in finding.why
    assert verdict.not_fired_line(finding).startswith(f"  chaos: {spec} never fired: rank 1's member finished")


def test_a_step_beyond_the_run_and_a_member_that_died_first_are_told_apart() -> None:
    late, killed = "kill:rank=0:step=20", "kill:rank=1:step=5:at=allreduce"
    records = [*steps("m0", 0, 9), *steps("m1", 1, 2),
               {"event": "member_failed", "member": "m1", "detected_by": "exit",
                "reason": "process ended (signal 9)"}]
    trails = verdict.trails_of(facts(records), ["m0", "m1"])
    first, second = verdict.not_fired([late, killed], {late: "m0", killed: "m1"}, trails)
    assert first.ended == verdict.Ended.RAN and "never reached step 20: its last finished step was 9" in first.why
    assert second.ended == verdict.Ended.FAILED
    assert "was declared dead (exit: process ended (signal 9)) before step 5; its last finished step was 2" \
        in second.why


def test_a_spec_that_fired_is_not_reported_and_a_seated_spare_is_named() -> None:
    fired, spare = "kill:rank=1:step=3", "kill:spare=0:after=30"
    records = [{"event": "chaos_injected", "member": "m1", "rank": 1, "action": "kill", "spec": fired},
               {"event": "view_committed", "epoch": 2, "resume_step": 2, "seats": ["m0", "s0"], "spares": []}]
    trails = verdict.trails_of(facts(records), ["m1", "s0"])
    [finding] = verdict.not_fired([fired, spare], {fired: "m1", spare: "s0"}, trails)
    assert finding.spec == spare and finding.rank == -1 and finding.ended == verdict.Ended.SEATED
    assert "spare 0 took seat 1 before it had waited 30 s" in finding.why


def test_only_a_finished_job_changes_its_status() -> None:
    unfired = verdict.not_fired(["kill:rank=1:step=20"], {}, verdict.Trails())
    rollback = summary.UntrackedRollback("DataLoader", "train.py:40", 2, 0)
    assert verdict.exit_status(0, unfired, None, strict=False)[0] == verdict.NOT_FIRED_STATUS == 4
    status, why = verdict.exit_status(0, unfired, rollback, strict=True)
    assert status == 4 and "kill:rank=1:step=20 never fired" in why, "a spec that never fired comes first"
    assert verdict.exit_status(0, [], rollback, strict=True)[0] == verdict.NOT_GUARANTEED_STATUS == 5
    assert verdict.exit_status(0, [], rollback, strict=False) == (0, "")
    assert verdict.exit_status(1, unfired, rollback, strict=True) == (1, "")
    assert verdict.exit_status(143, unfired, None, strict=False) == (143, "")
    assert verdict.exit_status(0, [], None, strict=True) == (0, "")


def test_the_closing_lines_name_the_untracked_loader_and_the_view_of_the_swap(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    finished = {"event": "training_finished", "member": "coordinator", "step": 11, "state_digest": "ab" * 32,
                "untracked_rollback": {"loader": "DataLoader", "where": "plain_loader_train.py:52", "view": 2,
                                       "rank": 0}}
    events.write_text(json.dumps(line(**finished)) + "\n")
    end = closing.read(str(events))
    assert end.untracked == summary.UntrackedRollback("DataLoader", "plain_loader_train.py:52", 2, 0)
    assert end.lines[-2] == (
        "  final state may differ from a failure-free run: an untracked DataLoader (iterated at "
        "plain_loader_train.py:52, rank 0) was not rolled back at the swap of view 2; track it (torchdata's "
        "StatefulDataLoader, rt.track(data=loader)) or derive its position from the step (--strict makes such a "
        "run exit 5)")
    assert end.lines[-1] == f"final state digest: {'ab' * 32}"
    plain = {key: value for key, value in finished.items() if key != "untracked_rollback"}
    events.write_text(json.dumps(line(**plain)) + "\n")
    end = closing.read(str(events))
    assert end.untracked is None and not [line for line in end.lines if "may differ" in line]
