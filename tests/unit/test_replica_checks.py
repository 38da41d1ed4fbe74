"""Replica checks without processes: the checksum, the parts it covers, the verdict, the rollback step, the slots.

The checksum must be the same for the same bytes on every seat and change for any flipped bit; the parts of
the replicated region must cover every byte once; the verdict names a minority only against a majority; the
coordinator's room resumes a corrupt job from the newest step known clean; a store keeps as many snapshots
as the replica checks need to reach it, and a restore plan never resumes past it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.audits import Audits, audit_verdict
from deadpool.coordinator.replicas import Corruption, ReplicaChecks
from deadpool.errors import MisuseError
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector
from deadpool.protocol.audits import audited_seat
from deadpool.protocol.messages import Audit, AuditDigest, PrepareAck
from deadpool.protocol.view import View
from deadpool.snapshot.checksum import checksum, part_ranges
from deadpool.snapshot.statetree import flatten, layout
from deadpool.snapshot.store import SnapshotStore
from deadpool.worker.faults import flip_bit


def test_every_single_bit_flip_changes_the_checksum() -> None:
    data = np.random.default_rng(0).integers(0, 256, size=203, dtype=np.uint8)
    reference = checksum([data[1:], data[:1]])
    for index in range(data.size):
        for bit in range(8):
            flipped = data.copy()
            flipped[index] ^= 1 << bit
            assert checksum([flipped[1:], flipped[:1]]) != reference, (index, bit)
    assert checksum([data[:1], data[1:]]) != reference, "pieces are combined in order"


def test_the_parts_cover_the_replicated_region_exactly_once() -> None:
    tensors = [torch.zeros(7), torch.zeros(3, 5), torch.zeros(11), torch.zeros(2)]
    skeleton, flat = flatten({"own": tensors[0], "a": tensors[1], "b": tensors[2], "c": tensors[3]})
    manifest = layout(flat, skeleton, [False, True, True, True], 4)
    wanted = {(i, b) for i, spec in enumerate(manifest.tensors) if spec.offset >= manifest.replicated_at
              for b in range(spec.nbytes)}
    for parts in (1, 2, 3, 5):
        covered = [(index, b) for part in range(parts) for index, lo, hi in part_ranges(manifest, part, parts)
                   for b in range(lo, hi)]
        assert sorted(covered) == sorted(wanted), parts
    assert part_ranges(layout(flat, skeleton, [False] * 4, 4), 0, 1) == [], "nothing replicated, nothing checked"


def test_flip_bit_flips_one_bit_of_the_middle_word() -> None:
    tensor = torch.zeros(9)
    flip_bit(tensor, 16)
    assert tensor.view(torch.int32).tolist() == [0, 0, 0, 0, 1 << 16, 0, 0, 0, 0]


def test_the_verdict_names_a_minority_only_against_a_majority() -> None:
    assert decisions.replica_verdict({0: 5, 1: 5, 2: 5, 3: 5})[0] == []
    minority, why = decisions.replica_verdict({0: 5, 1: 5, 2: 9, 3: 5})
    assert minority == [2] and "3 other" in why
    assert decisions.replica_verdict({0: 5, 1: 9})[0] is None, "two seats that disagree: nobody can be named"
    assert decisions.replica_verdict({0: 5, 1: 5, 2: 9, 3: 9})[0] is None


def test_a_restore_after_a_corruption_never_resumes_past_the_newest_clean_step() -> None:
    view = View(3, ["m0", "m1", "m2"], [], 4, "epoch-3", "h:1", {}, {}, [1, 2, 0], {})
    acks = {f"m{i}": PrepareAck(f"m{i}", 4, 6, [4, 5, 6], {(i + 2) % 3: [4, 5, 6]}) for i in (0, 1)}
    assert decisions.plan_restore(view, [2], acks)[0] == 6
    assert decisions.plan_restore(view, [2], acks, limit=5)[0] == 5
    step, _, why = decisions.plan_restore(view, [2], acks, limit=3)
    assert step is None and "step 3" in why and "too late" in why


class Views:
    """The views the room reads: one current view, and the epoch whose groups are in use."""

    def __init__(self, view: View) -> None:
        self.current: View | None = view
        self.groups_epoch = view.epoch


def room(parts: int) -> tuple[ReplicaChecks, list[str]]:
    failures: list[str] = []
    view = View(2, ["m0", "m1", "m2", "m3"], ["s"], -1, "epoch-2", "h:1", {}, {}, [1, 2, 3, 0], {})
    return ReplicaChecks(parts, 1, EventLog(None), Views(view), failures.append), failures  # type: ignore[arg-type]


def tell(checks: ReplicaChecks, step: int, digests: list[int]) -> list[Corruption]:
    found: list[Corruption] = []
    for seat, digest in enumerate(digests):
        found += checks.told(f"m{seat}", [[2, step, digest]])
    return found


@pytest.mark.parametrize("parts", [1, 3])
def test_a_disagreeing_seat_is_named_once_with_the_step_to_resume_from(parts: int) -> None:
    checks, failures = room(parts)
    for step in range(6):
        assert tell(checks, step, [step] * 4) == []
    (found,) = tell(checks, 6, [6, 6, 99, 6])
    assert (found.seat, found.member, found.step) == (2, "m2", 6)
    assert found.rollback_step == 6 - parts, "the part found bad was last seen good `parts` checks ago"
    assert tell(checks, 7, [7, 7, 98, 7]) == [], "a seat is named once"
    assert checks.found == [(2, 6)] and failures == []


def test_a_split_without_a_majority_stops_the_job() -> None:
    checks, failures = room(1)
    tell(checks, 0, [0] * 4)
    assert tell(checks, 1, [1, 1, 2, 2]) == []
    (failure,) = failures
    assert "silent data corruption at step 1" in failure and "no majority" in failure


def test_a_store_keeps_as_many_snapshots_as_its_depth() -> None:
    store = SnapshotStore(on_complete=lambda _: None, depth=Config(replica_checks=1).snapshot_depth)
    try:
        weight = torch.zeros(8)
        for step in range(6):
            weight.add_(1.0)
            slot = store.capture(step, "g", {"w": weight}, set(), {weight.data_ptr()}, 0, 2, check=(0, 1))
            store.wait_copy(10.0)
            assert slot.check == checksum([weight.view(torch.uint8).numpy()])
        assert store.complete_steps() == [3, 4, 5]
    finally:
        store.close()
    assert Config(replica_checks=0).snapshot_depth == 2 and Config(replica_checks=4).snapshot_depth == 6


def test_a_negative_replica_check_setting_is_refused() -> None:
    with pytest.raises(MisuseError, match="replica_checks"):
        Config(replica_checks=-1).validate()


class Outbox:
    """What the audits room sends, kept."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, address: str, message: object) -> None:
        self.sent.append((address, message))


class Record:
    def __init__(self, member: str, step: int) -> None:
        self.member, self.step, self.control_addr = member, step, f"addr-{member}"


def test_an_audit_names_the_seat_whose_gradients_differ_and_resumes_from_its_last_clean_audit() -> None:
    view = View(2, ["m0", "m1", "m2", "m3"], ["s"], -1, "epoch-2", "h:1", {}, {}, [1, 2, 3, 0], {})
    records = {m: Record(m, 10) for m in [*view.seats, "s"]}
    out = Outbox()
    audits = Audits(True, EventLog(None), Views(view), records, out, lambda: ["s"],  # type: ignore[arg-type]
                    lambda: None, lambda: False)

    def seats_digest(first: int, last: int, digest: int = 7) -> None:
        for step in range(first, last):
            seat = audited_seat(step, 4)
            assert audits.digest(AuditDigest(f"m{seat}", 2, seat, step, digest)) == []

    audits.tick(0.0)
    assert out.sent == [], "no seat digested a step yet"
    seats_digest(0, 8)
    for seat in range(4):
        audits.tick(float(seat))
        (to_spare, audit), = out.sent[-1:]
        assert isinstance(audit, Audit) and (to_spare, audit.seat, audit.step) == ("addr-s", seat, 4 + seat)
        audits.tick(float(seat))  # one at a time
        assert len(out.sent) == seat + 1
        assert audits.digest(AuditDigest("s", 2, seat, 4 + seat, 7)) == []
    seats_digest(8, 12)
    audits.tick(9.0)
    audits.digest(AuditDigest("s", 2, 0, 8, 0, missed="the spare was needed"))
    assert audits.missed == 1
    seats_digest(12, 16, digest=8)
    audits.tick(10.0)
    assert out.sent[-1][1].step == 13  # type: ignore[attr-defined]
    (found,) = audits.digest(AuditDigest("s", 2, 1, 13, 9))
    assert (found.seat, found.step, found.detector) == (1, 13, Detector.AUDIT)
    assert found.rollback_step == 5, "the seat's last clean audit"
    assert audits.done == 4 and audit_verdict(1, 5, 5)[0] and not audit_verdict(1, 5, 6)[0]
