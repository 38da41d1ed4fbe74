"""Launches and chaos specs that can never do what they say: refused (exit 2) or warned, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from deadpool.tools.cli import main  # type: ignore[import-not-found]  (tools/ is installed as deadpool.tools)

from deadpool.agent.checks import check_launch, visible_steps
from deadpool.chaos import parse, unreachable

REPO = Path(__file__).resolve().parents[2]


def test_a_rank_beyond_the_world_is_refused_naming_the_spec_and_the_world() -> None:
    refusal, warning = unreachable(parse("kill:rank=4:step=3"), world=4, spares=1, steps=None)
    assert "'kill:rank=4:step=3'" in refusal and "4 seat(s)" in refusal and warning == ""
    assert unreachable(parse("kill:rank=3:step=3"), world=4, spares=1, steps=None) == ("", "")


def test_across_hosts_the_world_is_nnodes_times_nproc() -> None:
    # --nnodes 2 --nproc 2: rank 3 lives on the other host, and is fine.
    assert check_launch(4, 1, [parse("kill:rank=3:step=3")], [], 0) == ([], [])
    assert check_launch(4, 1, [parse("kill:rank=4:step=3")], [], 0)[0]


def test_a_spare_beyond_spares_is_refused() -> None:
    refusal, _ = unreachable(parse("kill:spare=1:after=2"), world=2, spares=1, steps=None)
    assert "spare 1" in refusal and "--spares 1" in refusal
    assert unreachable(parse("kill:spare=0:after=2"), world=2, spares=1, steps=None) == ("", "")


def test_a_step_beyond_visible_steps_is_only_a_warning() -> None:
    refusals, warnings = check_launch(4, 1, [parse("kill:rank=1:step=40")], ["--steps", "30"], 0)
    assert refusals == [] and len(warnings) == 1
    assert "step 40" in warnings[0] and "--steps 30" in warnings[0]
    assert "sees only the script's arguments" in warnings[0]
    assert check_launch(4, 1, [parse("kill:rank=1:step=29")], ["--steps", "30"], 0) == ([], [])
    assert check_launch(4, 1, [parse("kill:rank=1:step=40")], [], 0) == ([], [])  # unknown: nothing said


def test_visible_steps_reads_both_forms_and_the_last_wins() -> None:
    assert visible_steps(["--steps", "30"]) == 30
    assert visible_steps(["--steps=12", "--lr", "3"]) == 12
    assert visible_steps(["--steps", "5", "--steps", "7"]) == 7
    assert visible_steps(["--max-steps", "5", "--steps"]) is None


def test_a_world_of_one_with_spares_needs_a_disk_checkpoint() -> None:
    [refusal], _ = check_launch(1, 1, [], [], 0)
    assert "no buddy" in refusal and "--checkpoint-every" in refusal
    assert check_launch(1, 1, [], [], 5) == ([], [])  # a disk checkpoint restores it
    assert check_launch(1, 0, [], [], 0) == ([], [])  # no spare: nothing promised
    assert check_launch(None, 1, [], [], 0) == ([], [])  # adding spares to a running job: world unknown


@pytest.mark.parametrize(("args", "expect"), [
    (["--nproc", "4", "--chaos", "kill:rank=4:step=3"], "names rank 4, but the world has 4 seat(s)"),
    (["--nproc", "1", "--spares", "1"], "no buddy"),
    (["--nproc", "2", "--spares", "1", "--standby-coordinator"], "--standby-coordinator needs --nnodes 3"),
    (["--nproc", "2", "--nnodes", "0"], "--nnodes must be at least 1, got 0"),
    (["--nproc", "2", "--events", "/nonexistent-deadpool/events.jsonl"], "must name a file in a folder that exists"),
    (["--nproc", "2", "--resume"], "--resume needs --checkpoint-dir DIR"),
    (["--nproc", "4", "--audit"], "--audit needs a spare"),
    (["--nproc", "4", "--spares", "1", "--replica-checks", "-1"], "replica_checks must be 0 (off) or more"),
    (["--nproc", "4", "--spares", "1", "--chaos", "corrupt:rank=1:step=3:what=weights"], "what= must be one of"),
    (["--nproc", "4", "--spares", "1", "--chaos", "corrupt:rank=4:step=3:what=param"], "names rank 4"),
    (["--nproc", "4", "--spares", "1", "--chaos", "corrupt:rank=1:step=3:what=param:bit=40"], "bit= must be 0..31"),
])
def test_the_cli_refuses_with_exit_2_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            args: list[str], expect: str) -> None:
    # In this process: the tier's guard fails the test if the refusal came after a process started.
    events = tmp_path / "events.jsonl"
    try:
        code = main(["launch", "--events", str(events), *args, str(REPO / "tests" / "fixtures" / "tiny_train.py"),
                     "--steps", "30"])
    except SystemExit as refused:  # argparse's own refusals
        code = refused.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert expect in stderr and stderr.startswith("deadpool launch: ")
    assert not events.exists()  # no coordinator, no worker
