"""The event schema: one typed record per event kind, the writer's and every reader's (pure logic, no processes).

`deadpool events FILE` and the simulator's invariant checks read lines through the same schema, so a field
renamed on one side is refused by both, with the line, the kind and the field named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deadpool.tools import cli
from deadpool.tools.simulate.checks import Checker

from deadpool.coordinator.service import Coordinator
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector, RestoreSource, Trigger

T0 = 1_700_000_000.0


class Run:
    """What the checker reads of a simulated run: a clock at tick 7 and every member healthy."""

    tick = 7

    @property
    def coordinator(self) -> Coordinator:
        raise AssertionError("not asked for by the events these tests feed")

    def now(self) -> float:
        return 0.7

    def healthy(self, member: str) -> bool:
        return True


def _lines(tmp_path: Path) -> list[bytes]:
    """A coordinator's lines as EventLog writes them: a member declared dead, then a spare restoring."""
    path = tmp_path / "events.jsonl"
    clock = iter(T0 + n for n in range(10))
    log = EventLog(path, member="coordinator", source="coordinator", clock=lambda: next(clock))
    log.emit(schema.MemberFailed(member="m1", rank=1, detected_by=Detector.EXIT, reason="process ended (signal 9)"))
    log.emit(schema.ViewPrepared(failed_seats=[1], reason="seat 1 lost", replacements={"1": "s0"},
                                 trigger=Trigger.SEAT_LOST, told=3, through_agents=0))
    log.close()
    return path.read_bytes().splitlines()


def test_a_written_line_reads_back_as_the_record_that_was_written(tmp_path: Path) -> None:
    written = schema.Restored(ts=T0, epoch=2, member="s0", rank=1, step=31, source=RestoreSource.BUDDY, bytes=10,
                              live_bytes=0, s=0.5, fetch_s=0.25, group_s=0.125, wait_s=0.0, preloaded=False)
    assert schema.decode(schema.encode(written)) == written
    line = json.loads(schema.encode(written))
    assert "groups_rebuilt" not in line and line["source"] == "buddy"  # optional fields left None stay out
    failed, prepared = (schema.decode(line) for line in _lines(tmp_path))
    assert isinstance(failed, schema.MemberFailed) and (failed.member, failed.rank) == ("m1", 1)
    assert failed.detected_by is Detector.EXIT and failed.source_process == "coordinator"
    assert isinstance(prepared, schema.ViewPrepared) and prepared.trigger is Trigger.SEAT_LOST


def test_a_step_line_keeps_the_scripts_own_reported_fields() -> None:
    step = schema.StepFinished(ts=T0, epoch=1, member="m0", rank=0, step=3, step_s=0.2, loss=1.5,
                               report={"lr": 0.01})
    line = json.loads(schema.encode(step))
    assert line["lr"] == 0.01 and "report" not in line and "tokens" not in line  # flat, as a plot reads it
    assert schema.decode(schema.encode(step)) == step


def test_an_unknown_kind_from_a_newer_writer_is_kept_by_name() -> None:
    record = schema.decode(b'{"ts": 1.5, "event": "disk_full", "member": "m2", "rank": 2, "free_bytes": 0}')
    assert isinstance(record, schema.Unrecognised)
    assert (record.event, record.ts, record.member, record.rank) == ("disk_full", 1.5, "m2", 2)


def test_a_renamed_field_fails_deadpool_events_and_the_simulators_checks_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(tmp_path)
    # As written, both read it: the timeline shows the death, and the checker counts it at this tick.
    checker = Checker(Run())  # type: ignore[arg-type]  # duck-typed: the events fed here read only tick/healthy
    for line in lines:
        checker.on_line(line)
    assert checker.failed_tick == {"m1": 7} and checker.view_change_tick
    assert cli.main(["events", str(tmp_path / "events.jsonl")]) == 0
    assert "detected_by=exit" in capsys.readouterr().out

    # One field renamed (as a writer that drifted from the schema would write it): both refuse the line.
    renamed = lines[0].replace(b'"detected_by":', b'"detector":')
    bad = tmp_path / "renamed.jsonl"
    bad.write_bytes(b"\n".join([renamed, lines[1]]) + b"\n")
    assert cli.main(["events", str(bad)]) == 2
    said = capsys.readouterr().err
    assert "renamed.jsonl:1: a 'member_failed' event does not match its schema" in said
    assert "missing required field `detected_by`" in said and "Traceback" not in said
    with pytest.raises(schema.SchemaError,
                       match=r"a 'member_failed' event does not match its schema: .*required field `detected_by`"):
        Checker(Run()).on_line(renamed)  # type: ignore[arg-type]


def test_a_value_outside_its_vocabulary_fails_both(tmp_path: Path) -> None:
    line = _lines(tmp_path)[1].replace(b'"trigger":"seat_lost"', b'"trigger":"a hunch"')
    refused = r"'view_prepared' event .*Invalid enum value 'a hunch' - at `\$\.trigger`"
    with pytest.raises(schema.SchemaError, match=refused):
        Checker(Run()).on_line(line)  # type: ignore[arg-type]
    bad = tmp_path / "vocabulary.jsonl"
    bad.write_bytes(line + b"\n")
    with pytest.raises(schema.SchemaError, match=r"vocabulary\.jsonl:1: .*\$\.trigger"):
        schema.read(bad)


def test_a_record_built_with_a_wrong_type_is_refused_where_it_is_written(tmp_path: Path) -> None:
    events = EventLog(str(tmp_path / "events.jsonl"), member="host:rank1:ab12", source="worker")
    restored = schema.Restored(source=RestoreSource.BUDDY, bytes=8, live_bytes=0, s=0.1, fetch_s=0.0, group_s=0.0,
                               wait_s=0.0, preloaded=False, groups_rebuilt=[7])  # type: ignore[list-item]
    with pytest.raises(schema.SchemaError, match=r"'restored' event does not match its schema.*groups_rebuilt"):
        events.emit(restored)
    events.close()
    assert (tmp_path / "events.jsonl").read_bytes() == b"", "nothing of a refused record reaches the file"
