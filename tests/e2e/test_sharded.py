"""End to end, sharded: the Llama demo under FSDP2 x tensor parallel (and FSDP2 alone) on rt.device_mesh.

Real processes, real gloo groups, real SIGKILLs and SIGSTOPs inside FSDP2's all-gathers and
reduce-scatters and tensor parallel's forward all-reduces; every run with failures must end with
the failure-free run's digest, and only the mesh groups that held a replaced seat, or on which a
survivor's lost step left a collective unfinished, are rebuilt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import References
from launch_util import REPO, LaunchResult, launch

LLAMA = REPO / "demos" / "train_llama.py"
STRAGGLER = REPO / "tests" / "fixtures" / "straggler_llama.py"  # the Llama demo, some seats slow to snapshot
SEPARATE_RS = REPO / "tests" / "fixtures" / "separate_reduce_scatter_llama.py"  # FSDP2's reduce-scatter group
STEPS = 16
MESH_2X2 = ("--size", "tiny", "--fsdp", "--tp", "2")
FSDP_4 = ("--size", "tiny", "--fsdp")
SAVE_EVERY = 4  # the demo's own torch.distributed.checkpoint saves (--save-every)
# The 2x2 mesh [[0, 1], [2, 3]] (dp, tp): seat 2 sits in dp group {0, 2} and tp group {2, 3}.
GROUPS_OF_SEAT_2 = {"deadpool:dp:0", "deadpool:tp:1"}


def run(tmp_path: Path, script_args: tuple[str, ...], *chaos: str, spares: int = 1) -> LaunchResult:
    args: list[str] = ["--nproc", "4", "--spares", str(spares)]
    for spec in chaos:
        args += ["--chaos", spec]
    return launch(tmp_path, *args, steps=STEPS, script=LLAMA, script_args=script_args)


@pytest.fixture(scope="module")
def mesh_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the failure-free run saves a torch.distributed.checkpoint every SAVE_EVERY steps."""
    return tmp_path_factory.mktemp("mesh_saves")


@pytest.fixture(scope="module")
def mesh_baseline(tmp_path_factory: pytest.TempPathFactory, mesh_saves: Path) -> LaunchResult:
    result = run(tmp_path_factory.mktemp("mesh"), (*MESH_2X2, "--save-every", str(SAVE_EVERY), "--save-dir",
                                                   str(mesh_saves)))
    assert result.returncode == 0 and result.digest, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def fsdp_baseline(references: References) -> LaunchResult:
    return references.get(LLAMA, ("--nproc", "4", "--spares", "1"), FSDP_4, STEPS)


def assert_recovered(result: LaunchResult, baseline: LaunchResult, seats: list[int]) -> None:
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest, "a sharded run with failures must end bit-identical"
    assert sorted(f["rank"] for f in result.of("member_failed")) == seats
    swapped = {r["rank"]: r for r in result.of("restored") if r["source"] == "buddy"}
    assert set(swapped) == set(seats), "each replaced seat restored its shards from its buddy"
    assert all(r["decisions_taken"] > 0 for r in swapped.values()), "and DTensor's decisions with them"
    assert "Traceback" not in result.output, "the user's loop never sees a traceback"


def assert_no_rollback(result: LaunchResult) -> None:
    """The survivors' lost step never reached optimizer.step(): each resumes from its live tensors, copying nothing
    back from its snapshot (the sharding decisions the lost step added do not count against its layout)."""
    local = [r for r in result.of("restored") if r["source"] == "local"]
    assert local and all(r["live_bytes"] > 0.9 * r["bytes"] for r in local), local


def rebuilt_groups(result: LaunchResult) -> set[str]:
    return {name for r in result.of("restored") for name in r.get("groups_rebuilt", [])}


def test_a_kill_at_a_step_boundary_rebuilds_only_the_dead_seats_groups(
    tmp_path: Path, mesh_baseline: LaunchResult,
) -> None:
    """Seat 2 dies as it begins step 9 while the survivors are still at step 8's boundary (each is slow to
    snapshot it), so none of them starts a collective the Prepare would leave unfinished.  Without the
    hold, seats 1 and 3 may get into step 9's all-gather on dp group {1, 3} and seat 1 into its tp
    all-reduce with seat 0 before the Prepare lands: those groups are then rightly rebuilt as dirty."""
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=2:step=9", steps=STEPS,
                    script=STRAGGLER, script_args=MESH_2X2, env={"STRAGGLER": "0,1,3:8:2.0"})
    assert_recovered(result, mesh_baseline, [2])
    assert rebuilt_groups(result) == GROUPS_OF_SEAT_2
    kept = {name for r in result.of("restored") for name in r.get("groups_kept", [])}
    assert kept == {"deadpool:dp:1", "deadpool:tp:0"}, "the two groups without seat 2 keep their communicators"
    assert all("mesh_group_s" in r for r in result.of("restored"))
    swap = result.of("swap_completed")
    assert len(swap) == 1 and swap[0]["groups_rebuilt"] == 2 and swap[0]["group_s"] > 0


def test_the_spare_holds_only_its_seats_shards(mesh_baseline: LaunchResult) -> None:
    """Each seat's snapshot is about a quarter of the model and optimizer state (its local shards)."""
    memory = {m["rank"]: m["snapshot_bytes"] for m in mesh_baseline.of("snapshot_memory")}
    assert sorted(memory) == [0, 1, 2, 3]
    total = sum(memory.values())
    assert all(0.2 * total < size < 0.3 * total for size in memory.values()), memory


@pytest.mark.parametrize("spec", [
    "kill:rank=0:step=11:at=reducescatter",  # FSDP2's gradient reduce-scatter in flight
    "kill:rank=3:step=7:at=forward",  # a tensor-parallel all-reduce in forward
    "stop:rank=1:step=8",  # hung, then fenced
])
def test_a_failure_inside_a_sharded_collective_is_bit_identical(
    tmp_path: Path, mesh_baseline: LaunchResult, spec: str,
) -> None:
    seat = int(spec.split("rank=")[1].split(":")[0])
    result = run(tmp_path, MESH_2X2, spec)
    assert_recovered(result, mesh_baseline, [seat])
    assert_no_rollback(result)


def test_two_kills_at_once_one_in_each_tensor_parallel_group(tmp_path: Path, mesh_baseline: LaunchResult) -> None:
    """Seats 0 and 2 (tp groups {0, 1} and {2, 3}); neither holds the other's copy (buddies: the next seat)."""
    result = run(tmp_path, MESH_2X2, "kill:rank=0:step=9:at=allgather", "kill:rank=2:step=9:at=allgather", spares=2)
    assert_recovered(result, mesh_baseline, [0, 2])
    # dp group {1, 3} of the two survivors is rebuilt only where one of them left a collective on it unfinished
    # (each stops its lost step's forward at its next submodule, wherever that is). The two deaths may fall in
    # one round or in two (seat 0 slow to reach its all-gather pauses before it, and dies in the replay): every
    # view's account counts.
    left_unfinished = {name for view in result.of("view_committed") for name in view["rebuild_groups"]}
    assert rebuilt_groups(result) == {"deadpool:dp:0", "deadpool:tp:0", "deadpool:tp:1"} | left_unfinished


def test_a_seat_that_takes_the_prepare_at_its_boundary_does_not_hold_its_healthy_groups(
    tmp_path: Path, mesh_baseline: LaunchResult,
) -> None:
    """Seat 3 is slow to snapshot step 8 (its scheduler's state_dict sleeps), so seat 2 (its tp partner)
    starts step 9 and is killed there while seat 3, its step finished, has yet to reach its boundary: it
    takes the Prepare there and never begins step 9.  Seat 1 waits in step 9's first all-gather on dp
    group {1, 3}; seat 3's pause notice must end that wait, not the group timeout (which once left seat 0
    to the Prepare deadline, and the job without a spare for it)."""
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=2:step=9", steps=STEPS,
                    script=STRAGGLER, script_args=MESH_2X2,
                    env={"STRAGGLER": "3:8:2.0"})
    assert_recovered(result, mesh_baseline, [2])
    timeouts = [f for f in result.of("collective_failed") if "no completion within" in f["error"]]
    assert not timeouts, timeouts
    swap_epoch = max(v["epoch"] for v in result.of("view_committed"))
    before = {f["step"] for f in result.of("step_finished") if f["rank"] == 3 and f["epoch"] < swap_epoch}
    assert max(before) == 8, "seat 3 finished step 8 before the swap, and no step after it"


def test_fsdp2s_own_reduce_scatter_group_is_rebuilt_with_the_mesh(tmp_path: Path, mesh_baseline: LaunchResult) -> None:
    """set_separate_reduce_scatter_group: FSDP2 makes the group with dist.new_group, a group of the script's own
    under DeadPool; seat 0 dies inside a reduce-scatter on it, and that group is rebuilt with seat 0's other two."""
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=0:step=7:at=reducescatter",
                    steps=STEPS, script=SEPARATE_RS, script_args=MESH_2X2)
    assert_recovered(result, mesh_baseline, [0])
    spare = next(r for r in result.of("restored") if r["source"] == "buddy")
    assert set(spare["groups_rebuilt"]) == {"deadpool:dp:0", "deadpool:tp:0", "deadpool:group:0-2"}
    kept = {name for r in result.of("restored") for name in r["groups_kept"]}
    assert "deadpool:group:1-3" in kept, "the other data-parallel pair's reduce-scatter group is kept"


def saved(folder: Path, scratch: Path) -> dict[str, Any]:
    """A torch.distributed.checkpoint folder's whole state, read in this process (through a file in `scratch`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, scratch)
    state: dict[str, Any] = torch.load(scratch)
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def test_a_kill_inside_the_scripts_own_checkpoint_save_leaves_every_checkpoint_as_without_failures(
        tmp_path: Path, mesh_baseline: LaunchResult, mesh_saves: Path) -> None:
    """Seat 1 dies in the first collective of step 7's dcp.save (torch's plan gathered on the default group): the
    survivors' save of the lost step ends quietly instead of raising CheckpointException (seat 0 checked a global
    plan made of its own), and the replayed step saves again: every checkpoint equals the failure-free run's."""
    result = run(tmp_path, (*MESH_2X2, "--save-every", str(SAVE_EVERY), "--save-dir", str(tmp_path / "saves")),
                 "kill:rank=1:step=7:at=usercollective")
    assert_recovered(result, mesh_baseline, [1])
    names = sorted(p.name for p in (tmp_path / "saves").iterdir())
    assert names == sorted(p.name for p in mesh_saves.iterdir()) == [f"step{s}" for s in (11, 15, 3, 7)]
    for name in names:
        assert same(saved(tmp_path / "saves" / name, tmp_path / f"{name}.pt"),
                    saved(mesh_saves / name, tmp_path / f"{name}-reference.pt")), f"{name} is not the failure-free one"


def test_fsdp_alone_survives_a_kill_in_an_all_gather(tmp_path: Path, fsdp_baseline: LaunchResult) -> None:
    result = run(tmp_path, FSDP_4, "kill:rank=1:step=9:at=allgather")
    assert_recovered(result, fsdp_baseline, [1])
    assert rebuilt_groups(result) == {"deadpool:dp:0", "deadpool:tp:1"}, "4-way dp group and seat 1's own tp group"


COMPILED = REPO / "tests" / "fixtures" / "compiled_mesh_train.py"  # FSDP2 or TP on 2 seats, then torch.compile


COMPILED_JOB = ("--nproc", "2", "--spares", "1")


@pytest.mark.parametrize(("parallel", "spec"), [
    ("fsdp", "kill:rank=1:step=5:at=allgather"),  # the survivor's forward is lost inside the compiled call
    ("tp", "kill:rank=0:step=7:at=forward"),
])
def test_a_compiled_model_on_the_mesh_survives_a_kill_bit_identically(
        tmp_path: Path, references: References, parallel: str, spec: str) -> None:
    # torch.compile of the tracked model traces DeadPool's guard of its forward: the guard must not hand
    # dynamo its stand-in outputs (mixed tensors and DTensors, a TorchRuntimeError in the script).
    baseline = references.get(COMPILED, COMPILED_JOB, ("--parallel", parallel), 10)
    result = launch(tmp_path, *COMPILED_JOB, "--chaos", spec, steps=10, script=COMPILED,
                    script_args=("--parallel", parallel), timeout=240)
    assert_recovered(result, baseline, [int(spec.split("rank=")[1].split(":")[0])])


BLOCKS = REPO / "tests" / "fixtures" / "compiled_blocks_train.py"  # FSDP2 x TP, bf16, checkpointed, compiled blocks
BLOCK_KILLS = [  # (compile form, kill); the default suite runs the one that failed before, --all-kill-points all
    ("inplace", "kill:rank=1:step=3:at=allgather"),  # block.compile(): the survivors' lost forward is compiled code
    *[pytest.param(form, spec, marks=pytest.mark.full_matrix) for form, spec in [
        ("wrap", "kill:rank=1:step=3:at=forward"),  # torch.compile(block): TP's forward all-reduce
        ("inplace", "kill:rank=1:step=3"),
        ("inplace", "kill:rank=1:step=3:at=reducescatter"),
        ("inplace", "kill:rank=1:step=3:at=forward"),
        ("wrap", "kill:rank=1:step=3"),
        ("wrap", "kill:rank=1:step=3:at=allgather"),
        ("wrap", "kill:rank=1:step=3:at=reducescatter"),
    ]],
]


@pytest.mark.parametrize(("form", "spec"), BLOCK_KILLS)
def test_compiled_blocks_survive_a_kill_in_every_collective_bit_identically(
        tmp_path: Path, references: References, form: str, spec: str) -> None:
    """Each block compiled, in place or by the wrapper: a survivor's lost step never makes dynamo trace DeadPool's
    forward guard (it would fall back to eager for good, and compute what the spare's compiled blocks do not)."""
    job = ("--nproc", "4", "--spares", "1")
    baseline = references.get(BLOCKS, job, ("--compile", form), 6)
    result = launch(tmp_path, *job, "--chaos", spec, script=BLOCKS, steps=6, script_args=("--compile", form))
    assert result.returncode == 0, result.output[-4000:]
    assert [f["rank"] for f in result.of("member_failed")] == [1]
    assert result.digest == baseline.digest, "a compiled run with a failure must end bit-identical"
    assert "falling back to eager" not in result.output
