"""End to end, expert parallel: a mixture-of-experts layer whose tokens travel by all_to_all on a mesh dimension.

tests/fixtures/expert_train.py on a (dp, ep) = (2, 2) mesh: each seat holds one expert, its router sends every
token to its expert's seat (the counts, then tokens in uneven splits, by ``all_to_all_single``), the outputs come
back the same way and their gradients travel back inside the backward. Real processes, real gloo all-to-alls,
real SIGKILLs inside the dispatch and inside the backward's; every run with a failure must end with the
failure-free run's digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import References
from launch_util import REPO, LaunchResult, launch

SCRIPT = REPO / "tests" / "fixtures" / "expert_train.py"
STEPS = 10
TOKENS = 32  # per seat per step


def run(tmp_path: Path, *chaos: str) -> LaunchResult:
    args: list[str] = ["--nproc", "4", "--spares", "1"]
    for spec in chaos:
        args += ["--chaos", spec]
    return launch(tmp_path, *args, steps=STEPS, script=SCRIPT)


@pytest.fixture(scope="module")
def baseline(references: References) -> LaunchResult:
    return references.get(SCRIPT, ("--nproc", "4", "--spares", "1"), (), STEPS)


def test_every_token_reaches_one_expert_of_its_group(baseline: LaunchResult) -> None:
    routed: dict[int, dict[int, int]] = {}
    for event in baseline.of("step_finished"):
        routed.setdefault(event["step"], {})[event["rank"]] = event["routed"]
    assert sorted(routed) == list(range(STEPS))
    for step, seats in routed.items():
        assert seats[0] + seats[1] == 2 * TOKENS and seats[2] + seats[3] == 2 * TOKENS, f"step {step}: {seats}"
    assert any(len(set(seats.values())) > 1 for seats in routed.values()), "the router splits tokens unevenly"


@pytest.mark.parametrize("spec", ["kill:rank=1:step=5:at=forward", "kill:rank=3:step=6:at=backward"],
                         ids=["in-the-dispatch", "in-the-backwards-all-to-all"])
def test_a_kill_inside_an_all_to_all_is_recovered_bit_identically(
    tmp_path: Path, baseline: LaunchResult, spec: str,
) -> None:
    result = run(tmp_path, spec)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest, "an expert-parallel run with a failure must end bit-identical"
    [injected] = result.of("chaos_injected")
    assert injected["spec"] == spec
    assert len(result.of("member_failed")) == 1
    assert "Traceback" not in result.output
