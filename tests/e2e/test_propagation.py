"""DTensor's sharding decisions travel in a seat's snapshot entry and spare a fresh process its cold first step
(worker/propagation.py): each case is a process of its own on torch's fake process group (no peers)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# One step of a small FSDP2 x TP model on a 2x2 mesh (the seat from argv), with gradient clipping; the decisions
# recorded (or taken from the file named in argv) are counted by what torch had to compute.
STEP = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from deadpool.worker.propagation import Decisions

    seat, source, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("fake", rank=seat, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    decisions = Decisions(mesh)
    computed = []
    compute = decisions._compute
    decisions._compute = lambda schema: computed.append(schema) or compute(schema)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    taken = decisions.take(torch.load(source)) if source != "-" else 0
    before = len(computed)
    model.load_state_dict(model.state_dict())  # what a restore does: a DTensor copy per parameter
    loading = len(computed) - before
    before = len(computed)
    model(torch.ones(4, 16)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    decisions.make_load_decisions([model])  # as the runtime does before its first snapshot
    entry = decisions.snapshot_entry()
    torch.save(entry, target)
    garbage = dict(entry, entries=1000, msgpack=torch.tensor([0x92, 0xc4, 0x01], dtype=torch.uint8))
    other_torch = dict(entry, torch="2.0.0", entries=1000)
    print(json.dumps({"taken": taken, "computed_in_load": loading, "computed_in_step": len(computed) - before,
                      "entries": entry["entries"], "recorded": len(decisions._recorded),
                      "retaken": decisions.take(entry), "garbage": decisions.take(garbage),
                      "other_torch": decisions.take(other_torch)}))
""")


def step(seat: int, source: Path | None, target: Path) -> dict[str, int]:
    proc = subprocess.run([sys.executable, "-c", STEP, str(seat), str(source or "-"), str(target)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def seat3(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], Path]:
    """A seat's first step, cold: every decision computed, and its snapshot entry."""
    entry = tmp_path_factory.mktemp("decisions") / "seat3.pt"
    return step(3, None, entry), entry


def test_a_cold_first_step_records_every_decision_and_the_entry_carries_them(
        seat3: tuple[dict[str, int], Path]) -> None:
    result, _ = seat3
    assert result["computed_in_step"] > 20  # the forward, backward, norm and optimizer ops of the model
    assert result["computed_in_load"] > 0, "a load's copies are decided too"
    assert result["entries"] == result["recorded"], "each of this model's decisions encodes"


def test_a_fresh_process_at_another_seat_takes_them_and_decides_nothing_in_its_first_step(
        seat3: tuple[dict[str, int], Path], tmp_path: Path) -> None:
    """The decisions hold no seat's coordinates: seat 3's serve seat 0 (another row and column of the mesh), in its
    restore's load and in its first step."""
    result = step(0, seat3[1], tmp_path / "seat0.pt")
    assert result["taken"] > 0
    assert result["computed_in_load"] == 0, "the restore's copies were decided before any failure, and carried"
    assert result["computed_in_step"] == 0


def test_a_process_takes_none_from_its_own_snapshot_a_broken_one_or_another_torchs(
        seat3: tuple[dict[str, int], Path]) -> None:
    """A survivor that loads its own snapshot decodes nothing (it has made as many decisions); bytes that do not
    decode, or that another torch version made (a checkpoint resumed after an upgrade: its rules may differ), are
    passed over (the decisions are made again), never an error in the restore."""
    result, _ = seat3
    assert result["retaken"] == 0
    assert result["garbage"] == 0
    assert result["other_torch"] == 0, "another torch version's decisions are made again"
