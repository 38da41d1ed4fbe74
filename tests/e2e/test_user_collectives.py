"""End to end: the script's own collectives on torch's default group, SyncBatchNorm, and rt.ddp's buffers.

The fixture script (tests/fixtures/collectives_train.py) all-reduces its batch
sizes and its loss with ``dist.all_reduce`` on the default group and trains a
model with an ``nn.SyncBatchNorm`` and a plain ``nn.BatchNorm1d`` through
``rt.ddp``; every seat's batch differs in size and distribution.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import References
from launch_util import REPO, LaunchResult, launch

SCRIPT = REPO / "tests" / "fixtures" / "collectives_train.py"
STEPS = 12
WORLD = 3
BUFFERS = re.compile(r"buffers seat=(\d+) syncbn=([0-9a-f]+) bn=([0-9a-f]+)")


def run(tmp_path: Path, *args: str, script_args: tuple[str, ...] = ()) -> LaunchResult:
    return launch(tmp_path, "--nproc", str(WORLD), "--spares", "1", *args, steps=STEPS, script=SCRIPT,
                  script_args=script_args, timeout=180)


def buffer_digests(result: LaunchResult) -> dict[int, tuple[str, str]]:
    """Each seat's (SyncBatchNorm, BatchNorm) buffer digests, as the seat's final member printed them."""
    return {int(seat): (sync, plain) for seat, sync, plain in BUFFERS.findall(result.output)}


def failure_free(tmp_path: Path, script_args: tuple[str, ...] = ()) -> LaunchResult:
    """A run without failures, checked as one: it finished, with a digest, and nothing failed."""
    result = run(tmp_path, script_args=script_args)
    assert result.returncode == 0, result.output[-3000:]
    assert result.digest, result.output[-3000:]
    assert not result.of("member_failed") and not result.of("collective_failed")
    return result


@pytest.fixture(scope="module")
def reference(references: References) -> LaunchResult:
    result = references.get(SCRIPT, ("--nproc", str(WORLD), "--spares", "1"), (), STEPS)
    assert not result.of("collective_failed")
    return result


def test_the_default_group_all_reduces_and_every_seat_ends_with_the_same_buffers(reference: LaunchResult) -> None:
    by_step: dict[int, dict[int, dict[str, float]]] = {}
    for event in reference.of("step_finished"):
        by_step.setdefault(event["step"], {})[event["rank"]] = event
    assert sorted(by_step) == list(range(STEPS))
    for step, seats in by_step.items():
        assert sorted(seats) == list(range(WORLD)), f"step {step}"
        mean = sum(s["loss"] for s in seats.values()) / WORLD
        for s in seats.values():
            assert s["mean_loss"] == pytest.approx(mean, rel=1e-6), f"step {step}: the all-reduced loss is the mean"
            assert s["global_batch"] == sum(12 + 4 * seat for seat in range(WORLD))
        assert len({s["loss"] for s in seats.values()}) == WORLD, "the seats' batches (and losses) differ"
    digests = buffer_digests(reference)
    assert sorted(digests) == list(range(WORLD))
    assert len(set(digests.values())) == 1, f"rt.ddp broadcasts buffers: every seat holds seat 0's ({digests})"


def test_sync_batchnorm_syncs_its_statistics_where_plain_batchnorm_does_not(tmp_path: Path) -> None:
    """Without rt.ddp's buffer broadcast only SyncBatchNorm keeps the seats' running statistics equal."""
    result = run(tmp_path, script_args=("--no-broadcast-buffers",))
    assert result.returncode == 0, result.output[-3000:]
    digests = buffer_digests(result)
    assert sorted(digests) == list(range(WORLD))
    assert len({sync for sync, _ in digests.values()}) == 1, f"SyncBatchNorm: global statistics ({digests})"
    assert len({plain for _, plain in digests.values()}) == WORLD, f"BatchNorm: each seat's own ({digests})"


def test_a_kill_during_the_scripts_all_reduce_is_recovered_bit_identically(
    tmp_path: Path, reference: LaunchResult,
) -> None:
    result = run(tmp_path, "--chaos", "kill:rank=1:step=6:at=usercollective")
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == reference.digest, "a run with a failure must end bit-identical"
    [injected] = result.of("chaos_injected")
    assert injected["at"] == "usercollective" and injected["step"] == 6
    assert [f["rank"] for f in result.of("member_failed")] == [1]
    paused = {e["rank"]: e["reason"] for e in result.of("paused") if e["step"] == 6}
    assert sorted(paused) == [0, 2], "both survivors lost step 6"
    # Killed with its all-reduce in flight; a survivor whose all-reduce had got the dead seat's part
    # already completes it and loses the step in the script's next collective (SyncBatchNorm's all-gather).
    assert all("of step 6 (the script's, on the default group)" in r for r in paused.values()), paused
    assert "Traceback" not in result.output, "a failed collective of the script's must not raise in it"
    [restored] = [r for r in result.of("restored") if r["source"] == "buddy"]
    assert restored["rank"] == 1
    assert buffer_digests(result) == buffer_digests(reference)


@pytest.fixture(scope="module")
def exchanging(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    """The fixture with --exchange: all_to_all_single, batch_isend_irecv, object collectives, reduce, gather."""
    return failure_free(tmp_path_factory.mktemp("exchanging"), ("--exchange",))


def test_all_to_all_point_to_point_and_object_collectives_carry_what_torch_does(exchanging: LaunchResult) -> None:
    by_step: dict[int, dict[int, dict[str, float]]] = {}
    for event in exchanging.of("step_finished"):
        by_step.setdefault(event["step"], {})[event["rank"]] = event
    assert sorted(by_step) == list(range(STEPS))
    for step, seats in by_step.items():
        assert sorted(seats) == list(range(WORLD)), f"step {step}"
        losses = sum(s["loss"] for s in seats.values())
        for rank, s in seats.items():
            assert s["routed"] == sum(1 + (rank + peer + step) % 3 for peer in range(WORLD)), f"step {step}"
            assert s["left"] == pytest.approx(seats[(rank - 1) % WORLD]["mine"], rel=1e-6), "the ring's send/recv"
            assert s["lr"] == pytest.approx(0.05 * 0.9 ** step), "seat 0's object, broadcast"
            assert s["object_losses"] == pytest.approx(losses, rel=1e-6), "all_gather_object"
        assert seats[0]["reduced"] == pytest.approx(losses, rel=1e-5), "reduce to seat 0"
        assert seats[0]["gathered"] == pytest.approx(losses, rel=1e-5), "gather to seat 0"
        assert "reduced" not in seats[1] and "gathered" not in seats[1]


def test_a_kill_inside_an_all_to_all_is_recovered_bit_identically(tmp_path: Path, exchanging: LaunchResult) -> None:
    """Killed in the token dispatch's first all_to_all_single: the survivors' later collectives of the step (the
    uneven all-to-all, the ring's recv, the object broadcast) complete locally without a traceback."""
    result = run(tmp_path, "--chaos", "kill:rank=1:step=6:at=usercollective", script_args=("--exchange",))
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == exchanging.digest, "a run with a failure must end bit-identical"
    assert [f["rank"] for f in result.of("member_failed")] == [1]
    paused = {e["rank"]: e["reason"] for e in result.of("paused") if e["step"] == 6}
    assert sorted(paused) == [0, 2] and all("all_to_all_single of step 6" in r for r in paused.values()), paused
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    """The fixture with --subgroups: its own groups [0, 1] and [1, 2] (dist.new_group), an all-reduce and a
    broadcast on each every step."""
    return failure_free(tmp_path_factory.mktemp("grouped"), ("--subgroups",))


def test_the_scripts_own_groups_reduce_and_broadcast_over_their_seats_only(grouped: LaunchResult) -> None:
    for event in grouped.of("step_finished"):
        seat = event["rank"]
        own = {key for key in event if key.startswith("count_")}
        assert own == {f"count_{a}{a + 1}" for a in (seat - 1, seat) if 0 <= a < WORLD - 1}, event
        for first in (seat - 1, seat):  # the group's batch sizes, plus its group ranks 0 and 1
            if f"count_{first}{first + 1}" in event:
                assert event[f"count_{first}{first + 1}"] == (12 + 4 * first) + (12 + 4 * (first + 1)) + 1
    means = {(e["step"], key): set() for e in grouped.of("step_finished") for key in e if key.startswith("mean_")}
    for event in grouped.of("step_finished"):
        for step, key in means:
            if event["step"] == step and key in event:
                means[(step, key)].add(event[key])
    assert all(len(values) == 1 for values in means.values()), "each group's seats got its first seat's mean"


@pytest.mark.parametrize(("chaos", "rebuilt", "kept"), [
    # Seat 2 is only in [1, 2]: seats 0 and 1 keep the communicator of [0, 1].
    ("kill:rank=2:step=5:at=usercollective", {"deadpool:group:1-2"}, {"deadpool:group:0-1"}),
    # Seat 1 is in both; killed with its first all-reduce on [0, 1] in flight.
    ("kill:rank=1:step=6:at=usercollective", {"deadpool:group:0-1", "deadpool:group:1-2"}, set()),
])
def test_a_kill_inside_the_scripts_own_group_rebuilds_its_groups_and_is_bit_identical(
    tmp_path: Path, grouped: LaunchResult, chaos: str, rebuilt: set[str], kept: set[str],
) -> None:
    result = run(tmp_path, "--chaos", chaos, script_args=("--subgroups",))
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == grouped.digest, "a run with a failure must end bit-identical"
    [injected] = result.of("chaos_injected")
    assert injected["at"] == "usercollective"
    assert {name for r in result.of("restored") for name in r["groups_rebuilt"]} == rebuilt
    assert {name for r in result.of("restored") for name in r["groups_kept"]} == kept
    assert "Traceback" not in result.output
