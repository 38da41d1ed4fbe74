"""The one reader of the events file: typed facts per record, and a summary fed record by record."""

from __future__ import annotations

from event_lines import typed

from deadpool.events import schema, summary

T0 = 1_700_000_000.0


def _records() -> list[schema.Line]:
    seats = ["m0", "m1"]
    return [typed(r) for r in [
        {"ts": T0, "event": "coordinator_started", "member": "coordinator", "address": "tcp://127.0.0.1:9"},
        {"ts": T0 + 0.1, "event": "member_joined", "member": "s0", "role": "spare", "source_process": "worker"},
        {"ts": T0 + 0.2, "event": "view_committed", "epoch": 1, "resume_step": -1, "seats": seats, "spares": ["s0"]},
        *({"ts": T0 + 1 + step, "event": "step_finished", "epoch": 1, "rank": rank, "member": seats[rank],
           "step": step, "loss": 2.0 - step / 10 + rank, "tokens": 512} for step in range(3) for rank in range(2)),
        # Seat 1's death, reported by the coordinator without a seat: the seat comes from m1's step lines.
        {"ts": T0 + 5, "event": "member_failed", "member": "m1", "detected_by": "exit", "reason": "signal 9",
         "detection_s": 0.02},
        {"ts": T0 + 5.1, "event": "member_failed", "member": "m1", "detected_by": "heartbeat", "reason": "again"},
        {"ts": T0 + 5.2, "event": "rejected", "member": "coordinator", "reason": "bad_mac"},
        {"ts": T0 + 5.3, "event": "rejected", "member": "coordinator", "reason": "bad_mac"},
        {"ts": T0 + 5.4, "event": "rejected", "member": "m0", "reason": "stale_view"},
        {"ts": T0 + 6, "event": "view_committed", "epoch": 2, "resume_step": 1, "seats": ["m0", "s0"], "spares": [],
         "failed_seats": [1], "reason": "m1 failed"},
        {"ts": T0 + 6.5, "event": "restored", "member": "s0", "rank": 1, "source": "buddy", "bytes": 1000, "s": 0.1,
         "step": 1},
        {"ts": T0 + 7, "event": "step_finished", "epoch": 2, "rank": 1, "member": "s0", "step": 2, "loss": 1.5},
        {"ts": T0 + 7, "event": "step_finished", "epoch": 2, "rank": 0, "member": "m0", "step": 2, "loss": 0.5},
        {"ts": T0 + 7.1, "event": "swap_completed", "rank": 1, "old_member": "m1", "new_member": "s0",
         "recovery_s": 2.1},
        {"ts": T0 + 8, "event": "paused", "member": "m0"},
        {"ts": T0 + 9, "event": "training_finished", "member": "coordinator", "step": 2, "state_digest": "ab" * 32},
        {"ts": T0 + 9.5, "event": "from_a_newer_writer", "member": "coordinator", "what": 1},
    ]]


def test_each_record_becomes_one_typed_fact() -> None:
    records = _records()
    assert summary.parse(records[0]) == summary.CoordinatorStarted(T0, "tcp://127.0.0.1:9")
    joined = summary.parse(records[1])
    assert isinstance(joined, summary.MemberJoined) and joined.spare and joined.process == "worker"
    failure = summary.parse(records[9], {"m1": 1})
    assert failure == summary.Failure(T0 + 5, "m1", 1, schema.Detector.EXIT, "signal 9", 0.02)
    view = summary.parse(records[14])
    assert isinstance(view, summary.ViewCommit) and view.refilled == (1,) and view.reason == "m1 failed"
    assert summary.parse(records[19]) is None  # in the catalogue, but nothing is kept of it
    assert isinstance(records[21], schema.Unrecognised) and summary.parse(records[21]) is None


def test_fed_record_by_record_it_gives_the_whole_files_summary() -> None:
    records = _records()
    whole = summary.summarize(records)
    live = summary.SummaryBuilder()  # no seat map up front: a live reader learns it as lines arrive
    for record in records:
        live.feed(record)
    assert live.summary() == whole

    assert [(f.member, f.rank, f.detected_by) for f in whole.failures] == [("m1", 1, "exit")]  # one per member
    assert [(v.epoch, v.resume_step) for v in whole.views] == [(1, -1), (2, 1)]
    assert [(s.rank, s.old_member, s.new_member, s.recovery_s) for s in whole.swaps] == [(1, "m1", "s0", 2.1)]
    assert [(r.source, r.bytes) for r in whole.restores] == [("buddy", 1000)]
    assert whole.rejected == 3 and whole.rejections == (("bad_mac", 2), ("stale_view", 1))
    assert [c.spares for c in whole.spare_changes] == [1, 0]
    assert whole.steps_finished == 3 and whole.replayed_steps == 1
    # The lowest rank speaks for each (epoch, step); the replayed step 2 shows up again in epoch 2.
    assert [(p.epoch, p.step, p.rank, p.loss) for p in whole.steps] == [
        (1, 0, 0, 2.0), (1, 1, 0, 1.9), (1, 2, 0, 1.8), (2, 2, 0, 0.5)]
    assert whole.unknown_events == ("paused", "from_a_newer_writer")
    assert whole.outcome == "finished" and whole.final_digest == "ab" * 32 and whole.final_step == 2


def test_a_seat_learned_after_the_failure_is_filled_in() -> None:
    builder = summary.SummaryBuilder()
    builder.feed(typed({"ts": T0, "event": "member_failed", "member": "m3", "rank": -1}))
    assert builder.summary().failures[0].rank is None
    builder.feed(typed({"ts": T0 + 1, "event": "view_committed", "epoch": 1, "seats": ["m0", "m1", "m2", "m3"]}))
    assert builder.summary().failures[0].rank == 3


def test_the_job_fails_once_with_its_first_reason() -> None:
    builder = summary.SummaryBuilder()
    builder.feed(typed({"ts": T0 + 1, "event": "job_failed", "reason": "no spare left"}))
    builder.feed(typed({"ts": T0 + 2, "event": "job_failed", "reason": "later"}))
    s = builder.summary()
    assert (s.outcome, s.job_failed, s.job_failed_ts) == ("failed", "no spare left", T0 + 1)


def test_the_chaos_findings_and_a_final_state_not_guaranteed_are_typed_facts() -> None:
    unseen = {"ts": T0 + 1, "event": "chaos_point_unseen", "member": "m1", "rank": 1, "step": 0,
              "spec": "kill:rank=1:step=3:at=reducescatter", "at": "reducescatter",
              "seen": ["boundary", "backward", "allreduce"]}
    finished = {"ts": T0 + 2, "event": "training_finished", "member": "coordinator", "step": 9, "state_digest": "ab",
                "untracked_rollback": {"loader": "DataLoader", "where": "train.py:40", "view": 2, "rank": 0}}
    not_fired = {"ts": T0 + 3, "event": "chaos_not_fired", "member": "agent-h", "spec": unseen["spec"],
                 "at": "reducescatter", "target_member": "m1", "target_rank": 1, "last_step": 9,
                 "seen": unseen["seen"], "ended": "ran", "why": "rank 1's member finished step 3 ..."}
    unseen_line, finished_line, not_fired_line = typed(unseen), typed(finished), typed(not_fired)
    assert summary.parse(unseen_line) == summary.ChaosPointUnseen(
        T0 + 1, "m1", 1, 0, unseen["spec"], "reducescatter", ("boundary", "backward", "allreduce"))
    assert summary.parse(not_fired_line) == summary.ChaosNotFired(
        T0 + 3, unseen["spec"], "reducescatter", "m1", 1, 9, ("boundary", "backward", "allreduce"), "ran",
        "rank 1's member finished step 3 ...")
    s = summary.summarize([unseen_line, finished_line, not_fired_line])
    assert s.untracked_rollback == summary.UntrackedRollback("DataLoader", "train.py:40", 2, 0)
    assert [f.spec for f in s.chaos_unseen] == [f.spec for f in s.chaos_not_fired] == [unseen["spec"]]
    assert s.unknown_events == ()
    assert summary.summarize([typed({**finished, "untracked_rollback": None})]).untracked_rollback is None
