"""Reading events files back: summary, text timeline and plot (pure logic, no processes)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib.font_manager  # noqa: F401  (a fresh machine builds its font cache on import, with a subprocess: at collection, outside the unit tier's refusals)
import pytest
from deadpool.tools.events.plot import plot
from deadpool.tools.events.text import format_timeline
from event_lines import line, typed

from deadpool.events import schema
from deadpool.events.summary import load, summarize

T0 = 1_700_000_000.0
DIGEST = "3fa9c2e1b0d4" + "0" * 52
MEMBERS = ["m-host-101-aa", "m-host-102-bb", "m-host-103-cc", "m-host-104-dd"]
SPARE = "m-host-105-ee"


class Job:
    """Writes the events file a small job would write, with a clock we control."""

    def __init__(self) -> None:
        self.now = T0
        self.records: list[dict[str, Any]] = []

    def emit(
        self,
        event: str,
        *,
        member: str = "",
        rank: int = -1,
        epoch: int = 1,
        step: int = -1,
        dt: float = 0.0,
        **fields: Any,
    ) -> None:
        self.now += dt
        self.records.append(
            line(event, ts=round(self.now, 6), epoch=epoch, member=member, rank=rank, step=step, **fields)
        )

    def start(self, spares: list[str]) -> None:
        self.emit("coordinator_started", member="coordinator", address="tcp://127.0.0.1:29500")
        for rank, member in enumerate(MEMBERS):
            self.emit("member_joined", member=member, rank=rank, role="active", dt=0.01)
        for member in spares:
            self.emit("member_joined", member=member, role="spare", dt=0.01)
        self.emit("view_committed", member="coordinator", resume_step=-1, seats=MEMBERS, spares=spares, dt=0.05)

    def steps(self, first: int, last: int, seats: list[str], epoch: int = 1) -> None:
        for step in range(first, last + 1):
            self.now += 0.2
            for rank, member in enumerate(seats):
                loss = 4.0 * math.exp(-step / 25) + 0.05 * rank
                self.emit(
                    "step_finished",
                    member=member,
                    rank=rank,
                    epoch=epoch,
                    step=step,
                    dt=0.001,
                    loss=loss,
                    tokens_per_s=20480.0,
                    step_s=0.2,
                )

    def finish(self, seats: list[str], step: int, epoch: int = 1) -> None:
        for rank, member in enumerate(seats):
            self.emit(
                "training_finished", member=member, rank=rank, epoch=epoch, step=step, state_digest=DIGEST, dt=0.002
            )

    def lines(self) -> list[schema.Line]:
        """The records as a reader gets them from the file."""
        return [schema.validate(r) for r in self.records]

    def write(self, path: Path, garbage: bool = False) -> Path:
        lines = [json.dumps(r) for r in self.records]
        if garbage:
            lines[3:3] = ["{not json", "", "[1, 2, 3]", '"a string"']
            lines.append('{"ts": 1700000999.0, "event": "step_fini')  # cut off by a crash
        path.write_text("\n".join(lines) + "\n")
        return path


def clean_run() -> Job:
    job = Job()
    job.start(spares=[SPARE])
    job.steps(0, 59, MEMBERS)
    job.finish(MEMBERS, 59)
    return job


def swap_run() -> Job:
    """Rank 2 is killed after step 32; the spare takes its seat; training resumes at step 32."""
    job = Job()
    job.start(spares=[SPARE])
    job.steps(0, 32, MEMBERS)
    job.emit("chaos_injected", member="coordinator", action="kill", via="operator", target_member=MEMBERS[2],
             target_rank=2, dt=0.05)
    job.emit("member_failed", member=MEMBERS[2], rank=2, detected_by="exit", reason="exit code -9", dt=0.04)
    # The same death written twice (a restarted coordinator, say): the summary must count it once.
    job.emit("member_failed", member=MEMBERS[2], rank=2, detected_by="heartbeat", reason="again", dt=0.01)
    seats = [MEMBERS[0], MEMBERS[1], SPARE, MEMBERS[3]]
    job.emit("view_committed", member="coordinator", epoch=2, resume_step=31, seats=seats, spares=[], dt=0.3)
    for rank in (0, 1, 3):
        job.emit(
            "restored",
            member=seats[rank],
            rank=rank,
            epoch=2,
            step=31,
            source="local",
            bytes=12_000_000,
            s=0.01,
            dt=0.01,
        )
    job.emit("restored", member=SPARE, rank=2, epoch=2, step=31, source="buddy", bytes=12_000_000, s=0.05, dt=0.1)
    job.steps(32, 32, seats, epoch=2)
    job.emit(
        "swap_completed",
        member="coordinator",
        epoch=2,
        rank=2,
        old_member=MEMBERS[2],
        new_member=SPARE,
        recovery_s=0.84,
        dt=0.01,
    )
    job.emit("fenced", member=MEMBERS[2], rank=2, reason="declared dead in epoch 2", dt=0.01)
    job.steps(33, 59, seats, epoch=2)
    job.finish(seats, 59, epoch=2)
    return job


def failed_run() -> Job:
    """No spare: rank 1 dies and the job stops."""
    job = Job()
    job.start(spares=[])
    job.steps(0, 10, MEMBERS)
    job.emit("member_failed", member=MEMBERS[1], rank=1, detected_by="heartbeat", dt=2.0)
    job.emit("job_failed", member="coordinator", reason="no spare left for rank 1 (policy: stop)", dt=0.01)
    return job


def test_load_skips_a_torn_last_line_and_names_a_bad_line(tmp_path: Path) -> None:
    job = clean_run()
    path = job.write(tmp_path / "events.jsonl")
    with path.open("a") as handle:
        handle.write('{"ts": 1700000999.0, "event": "step_fini')  # cut off by a crash
    assert load(path) == job.lines()
    path = job.write(tmp_path / "events.jsonl", garbage=True)
    with pytest.raises(schema.SchemaError, match=r"events\.jsonl:4: not a JSON event line"):
        load(path)


def test_failure_free_run(tmp_path: Path) -> None:
    events = load(clean_run().write(tmp_path / "events.jsonl"))
    s = summarize(events)
    assert s.steps_finished == 60
    assert s.last_step == 59
    assert s.replayed_steps == 0
    assert s.failures == () and s.swaps == () and s.restores == ()
    assert [(v.epoch, v.resume_step) for v in s.views] == [(1, -1)]
    assert s.final_digest == DIGEST and s.final_step == 59
    assert s.job_failed is None and s.outcome == "finished"
    assert [c.spares for c in s.spare_changes] == [1]

    text = format_timeline(events)
    assert text.startswith("    +0.000s  coordinator_started")
    assert "step_finished" not in text
    assert text.count("progress") == 13  # steps 0, 5, ..., 55 (at most ~20 lines), and the last one
    assert "progress            step 59  loss=" in text
    assert "progress            step 10  loss=" in text
    assert "(same from 4 ranks)" in text
    assert text.count("training_finished") == 1
    assert f"final digest     {DIGEST}" in text
    assert "outcome          finished at step 59" in text


def test_kill_and_swap(tmp_path: Path) -> None:
    events = load(swap_run().write(tmp_path / "events.jsonl"))
    s = summarize(events)

    assert len(s.failures) == 1
    failure = s.failures[0]
    assert (failure.member, failure.rank, failure.detected_by) == (MEMBERS[2], 2, "exit")
    assert failure.ts is not None and failure.reason == "exit code -9"
    assert [(v.epoch, v.resume_step) for v in s.views] == [(1, -1), (2, 31)]
    assert s.views[1].seats[2] == SPARE
    assert len(s.swaps) == 1
    swap = s.swaps[0]
    assert (swap.rank, swap.old_member, swap.new_member, swap.recovery_s) == (2, MEMBERS[2], SPARE, 0.84)
    assert sorted(r.source for r in s.restores) == ["buddy", "local", "local", "local"]
    assert s.restores[-1].bytes == 12_000_000 and s.restores[-1].s == 0.05
    assert [c.spares for c in s.spare_changes] == [1, 0]
    assert s.steps_finished == 60 and s.replayed_steps == 1  # step 32 ran twice
    assert [(c.action, c.rank) for c in s.chaos] == [("kill", 2)]
    assert s.fenced == 1
    assert s.final_digest == DIGEST and s.outcome == "finished"

    text = format_timeline(events)
    assert f"member_failed       rank 2 ({MEMBERS[2]}) detected_by=exit" in text
    assert "view_committed      epoch 2 resume_step=31 world=4 spares=0" in text
    assert f"restored            rank 2 ({SPARE}) from buddy step 31 12.0 MB in 0.050 s" in text
    assert f"swap_completed      rank 2: {MEMBERS[2]} -> {SPARE} recovery 0.840 s" in text
    assert "chaos_injected      action=kill rank 2" in text
    assert "fenced              rank 2" in text
    assert f"rank 2: {MEMBERS[2]} -> {SPARE}  recovery 0.840 s" in text  # summary block
    assert "1 replayed after rollback" in text
    # Where it stopped and where it went on, although 32 is not a round step.
    lines = text.splitlines()
    chaos = next(i for i, line in enumerate(lines) if "chaos_injected" in line)
    assert "step 32 " in lines[chaos - 1] and "epoch 1)" in lines[chaos - 1]
    view = next(i for i, line in enumerate(lines) if "view_committed      epoch 2" in line)
    assert "step 32 " in lines[view + 5] and "epoch 2)" in lines[view + 5]
    # Lines are in time order and relative to the first event.
    body = text.split("\nsummary\n")[0].splitlines()
    times = [float(line.split()[0][1:-1]) for line in body if line.strip()]
    assert times == sorted(times) and times[0] == 0.0


def test_failed_job(tmp_path: Path) -> None:
    events = load(failed_run().write(tmp_path / "events.jsonl"))
    s = summarize(events)
    assert s.outcome == "failed"
    assert s.job_failed == "no spare left for rank 1 (policy: stop)"
    assert s.final_digest is None and s.swaps == ()
    assert [(f.rank, f.detected_by) for f in s.failures] == [(1, "heartbeat")]
    assert s.spare_changes == ()

    text = format_timeline(events)
    assert "job_failed          coordinator reason='no spare left for rank 1 (policy: stop)'" in text
    assert "outcome          FAILED: no spare left for rank 1 (policy: stop)" in text
    assert "final digest     (none)" in text


def test_a_line_off_its_schema_is_refused_and_an_unknown_kind_is_shown_generically(tmp_path: Path) -> None:
    bad = [({"ts": T0, "event": "member_failed", "member": "m1", "reason": "r"},
            "missing required field `detected_by`"),
           ({**line("view_committed", ts=T0), "epoch": "x"}, "Expected `int | null`, got `str` - at `$.epoch`"),
           ({**line("member_failed", ts=T0), "detected_by": "a hunch"}, "Invalid enum value 'a hunch'")]
    for record, said in bad:
        path = tmp_path / "events.jsonl"
        path.write_text(json.dumps(line("paused", ts=T0)) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(schema.SchemaError) as raised:
            load(path)
        assert f"events.jsonl:2: a {record['event']!r} event does not match its schema" in str(raised.value)
        assert said in str(raised.value)

    events = [typed({"ts": T0 + 5, "event": "disk_full", "member": "m-x", "rank": 1, "free_bytes": 0}),
              typed({"ts": T0 + 6, "event": "swap_completed", "recovery_s": 1.5})]
    s = summarize(events)
    assert s.unknown_events == ("disk_full",) and len(s.swaps) == 1
    text = format_timeline(events)
    assert "disk_full           rank 1 (m-x) free_bytes=0" in text
    assert format_timeline([]).startswith("(no events)")


@pytest.mark.parametrize("make", [clean_run, swap_run, failed_run, Job], ids=["clean", "swap", "failed", "empty"])
def test_plot_writes_png(tmp_path: Path, make: Any) -> None:
    events = load(make().write(tmp_path / "events.jsonl"))
    out = tmp_path / "timeline.png"
    plot(events, out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


def test_spare_pool_follows_joins_views_and_losses() -> None:
    job = Job()
    job.start(spares=[SPARE, "m-host-106-ff"])
    job.emit("spare_lost", member="m-host-106-ff", dt=1.0)
    job.emit("member_joined", member="m-host-107-gg", role="spare", dt=1.0)
    job.emit("rejected", member="coordinator", reason="join from an unknown job", dt=0.1)
    s = summarize(job.lines())
    assert [(c.cause, c.spares) for c in s.spare_changes] == [
        ("member_joined", 1),
        ("member_joined", 2),
        ("spare_lost", 1),
        ("member_joined", 2),
    ]
    assert s.rejected == 1 and s.outcome == "incomplete"
    text = format_timeline(job.lines())
    assert "spare_lost          m-host-106-ff" in text
    assert "spare pool       1 -> 2 -> 1 -> 2" in text
    assert "rejected            coordinator reason='join from an unknown job'" in text


def test_explicit_progress_interval_and_digest_disagreement() -> None:
    job = clean_run()
    job.records[-1]["state_digest"] = "ff" * 32  # rank 3 ends in another state
    text = format_timeline(job.lines(), progress_every=30)
    assert text.count("progress") == 3  # steps 0, 30 and the last one, 59
    assert "(same from 3 ranks)" in text
    assert f"rank 3 ({MEMBERS[3]}) step 59 digest={'ff' * 32}" in text
    assert summarize(job.lines()).final_digest == DIGEST  # rank 0 speaks for the job


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deadpool.errors import MisuseError

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MisuseError, match=r"deadpool\[plot\]"):
        plot(clean_run().lines(), tmp_path / "never.png")
    assert not (tmp_path / "never.png").exists()


def test_events_of_a_file_that_is_not_there_or_empty_is_a_clear_misuse(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deadpool.tools import cli

    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    for path, said in ((tmp_path / "missing.jsonl", "cannot read the events file"), (tmp_path, "Is a directory"),
                       (empty, "holds no events")):
        assert cli.main(["events", str(path)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err


def test_events_the_summary_leaves_out_are_not_called_unknown_when_the_catalogue_has_them() -> None:
    events: list[dict[str, Any]] = [
        {"ts": T0 + 1, "event": "paused", "rank": 0, "step": 5},
        {"ts": T0 + 2, "event": "disk_full", "rank": 1},
    ]
    shown = format_timeline([typed(e) for e in events]).splitlines()
    assert [text.split()[-1] for text in shown if "other events" in text] == ["paused"]
    assert [text.split()[-1] for text in shown if "unknown events" in text] == ["disk_full"]


def test_the_timeline_shows_chaos_that_never_fired_and_a_final_state_not_guaranteed() -> None:
    spec = "kill:rank=1:step=3:at=reducescatter"
    events: list[dict[str, Any]] = [
        {"ts": T0 + 1, "event": "chaos_point_unseen", "member": "m1", "rank": 1, "step": 0, "spec": spec,
         "at": "reducescatter", "seen": ["boundary", "backward", "allreduce"]},
        {"ts": T0 + 2, "event": "training_finished", "member": "coordinator", "step": 9, "state_digest": "ab" * 32,
         "untracked_rollback": {"loader": "DataLoader", "where": "train.py:40", "view": 2, "rank": 0}},
        {"ts": T0 + 3, "event": "chaos_not_fired", "member": "agent-h", "spec": spec, "at": "reducescatter",
         "target_member": "m1", "target_rank": 1, "last_step": 9, "seen": [], "ended": "ran",
         "why": "rank 1's member finished step 3 (and steps up to 9) without passing a reducescatter point"},
    ]
    text = format_timeline([typed(e) for e in events])
    assert "chaos_point_unseen" in text and "seen=boundary,backward,allreduce" in text
    assert f"chaos not fired  {spec}: rank 1's member finished step 3" in text
    assert "chaos unseen     kill:rank=1:step=3:at=reducescatter: rank 1 (m1)'s first step (step 0) passed no " \
        "reducescatter point (it passed boundary, backward, allreduce)" in text
    assert "not guaranteed   the final state may differ from a failure-free run's: an untracked DataLoader " \
        "(train.py:40) was not rolled back at the swap of view 2" in text
    assert "other events" not in text and "unknown events" not in text
