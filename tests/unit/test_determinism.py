"""--check-determinism's comparison: which tracked object or RNG first differs between three runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from event_lines import line, typed

from deadpool.agent.determinism import Run, compare, digests_of, kill_spec
from deadpool.chaos import NOT_FIRED_STATUS
from deadpool.errors import MisuseError


def seats(**overrides: str) -> dict[int, dict[str, str]]:
    base = {"model": "a", "optimizer": "b", "loader": "c", "rng:torch": "t", "rng:python": "p"}
    return {rank: {**base, **{k.replace("__", ":"): v for k, v in overrides.items()}} for rank in (0, 1)}


def run(label: str, digests: dict[int, dict[str, str]], failures: int = 0, code: int = 0) -> Run:
    return Run(label, code, digests, failures)


def test_three_identical_runs_agree() -> None:
    ok, lines = compare(run("a", seats()), run("b", seats()), run("k", seats(), failures=1))
    assert ok and lines[-1].startswith("all three runs agree: 3 tracked object(s) and 2 RNG(s) on 2 seat(s)")


def test_the_first_tracked_object_that_differs_after_the_kill_is_named() -> None:
    ok, lines = compare(run("a", seats()), run("b", seats()), run("k", seats(optimizer="x", loader="y"), failures=1))
    assert not ok and "first difference: tracked object 'optimizer' on rank(s) [0, 1]" in lines[-1]


def test_an_rng_that_differs_after_the_kill_is_named() -> None:
    ok, lines = compare(run("a", seats()), run("b", seats()), run("k", seats(rng__torch="x"), failures=1))
    assert not ok and "the torch RNG" in lines[-1]


def test_an_unseeded_rng_is_noted_and_not_compared() -> None:
    ok, lines = compare(run("a", seats()), run("b", seats(rng__python="q")),
                        run("k", seats(rng__python="r"), failures=1))
    assert ok and "the python RNG differs between the two failure-free runs" in lines[0]
    assert "and 1 RNG(s)" in lines[-1]


def test_a_script_that_is_not_reproducible_by_itself_fails_before_the_kill_is_judged() -> None:
    ok, lines = compare(run("a", seats()), run("b", seats(model="z")), run("k", seats(), failures=1))
    assert not ok and "'model' differs between the two failure-free runs" in lines[-1]


def test_a_kill_that_never_fired_or_a_failed_run_is_a_failure() -> None:
    assert not compare(run("a", seats()), run("b", seats()), run("k", seats()))[0]
    ok, lines = compare(run("a", seats()), run("b", {}, code=1), run("k", seats(), failures=1))
    assert not ok and "did not finish (exit 1)" in lines[0]


def test_a_kill_run_whose_launch_says_its_spec_never_fired_fails_the_check_with_that_status(tmp_path: Path) -> None:
    # The kill run's launcher exits NOT_FIRED_STATUS (4) when its spec never fired: named as such, not as a run
    # that "did not finish", and the check itself exits with the same status.
    ok, lines = compare(run("a", seats()), run("b", seats()), run("k", seats(), code=NOT_FIRED_STATUS))
    assert not ok and "saw no failure (exit 4): the kill never fired" in lines[0]
    import argparse

    from deadpool.agent.determinism import check

    args = argparse.Namespace(nnodes=1, coordinator="", nproc=2, spares=0, chaos=["kill:rank=1:step=3:at=allgather"],
                              events="", resume=False, checkpoint_dir="", check_determinism=True, strict=True)
    events = tmp_path / "run.jsonl"
    events.write_text("".join(json.dumps(line("seat_finished", rank=rank, parts={"model": "a"})) + "\n"
                              for rank in (0, 1)))
    codes = iter([0, 0, NOT_FIRED_STATUS])
    stricts: list[bool] = []
    assert check(args, 8, lambda run_args: (stricts.append(run_args.strict) or next(codes), str(events))) == 4
    assert stricts == [False, False, False], "the runs of the check are not --strict: it compares digests itself"
    codes = iter([0, 1, NOT_FIRED_STATUS])
    assert check(args, 8, lambda run_args: (next(codes), str(events))) == 1, "a failed reference run comes first"


def test_digests_come_from_the_seat_finished_events() -> None:
    records = [typed(r) for r in [
        {"event": "member_failed", "member": "m1", "rank": 1},
        {"event": "seat_finished", "rank": 0, "parts": {"model": "a", "__rng__": "all"}, "rngs": {"torch": "t"}},
        {"event": "seat_finished", "rank": 1, "parts": {"model": "b", "__rng__": "all"}, "rngs": {"torch": "u"}},
    ]]
    assert digests_of(records) == ({0: {"model": "a", "rng:torch": "t"}, 1: {"model": "b", "rng:torch": "u"}}, 1, False)


def test_the_default_kill_is_rank_1_half_way() -> None:
    assert kill_spec(4, 30) == "kill:rank=1:step=15"
    assert kill_spec(2, None) == "kill:rank=1:step=5"


def test_each_run_writes_its_disk_checkpoints_to_a_folder_of_its_own(tmp_path: Path) -> None:
    # The second run would otherwise meet the first run's checkpoints, which stop a run from step 0.
    import argparse

    from deadpool.agent.determinism import check

    args = argparse.Namespace(nnodes=1, coordinator="", nproc=2, spares=0, chaos=[], events="", resume=False,
                              checkpoint_dir=str(tmp_path), check_determinism=True)
    folders: list[str] = []
    check(args, 8, lambda run_args: (folders.append(run_args.checkpoint_dir) or 1, str(tmp_path / "none.jsonl")))
    assert folders == [str(tmp_path / f"run{i}") for i in (1, 2, 3)]
    with pytest.raises(MisuseError, match="drop --resume"):
        check(argparse.Namespace(**{**vars(args), "resume": True}), 8, lambda run_args: (0, ""))


def test_an_unrepaired_corruption_names_the_object_and_says_why() -> None:
    same = {0: {"model": "a"}, 1: {"model": "a"}}
    flipped = Run("with a kill", 0, {0: {"model": "a"}, 1: {"model": "b"}}, 0, corrupted=True)
    ok, lines = compare(run("failure-free", same), run("failure-free again", same), flipped)
    assert not ok and "tracked object 'model' on rank(s) [1]" in lines[-1] and "corruption" in lines[-1]
