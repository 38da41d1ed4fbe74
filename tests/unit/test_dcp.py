"""The script's own torch.distributed.checkpoint saves end quietly in a lost step (worker/dcp.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from deadpool.worker.dcp import _quiet_when_lost


class Save:
    """torch's ``_save_state_dict`` as the wrapper sees it: what it was asked, what it raises."""

    def __init__(self, raises: BaseException | None = None, loses: list[bool] | None = None) -> None:
        self.calls = 0
        self.raises = raises
        self.loses = loses  # set to lost inside, as a collective that completed locally would

    def __call__(self, state_dict: dict[str, Any], storage_writer: Any = None, process_group: Any = None,
                 coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None,
                 use_collectives: bool = True) -> str:
        self.calls += 1
        if self.loses is not None:
            self.loses[0] = True
        if self.raises is not None:
            raise self.raises
        return "metadata"


def wrap(save: Save, lost: list[bool]) -> Any:
    return _quiet_when_lost(save, lambda: lost[0], lambda: "stand-in")


def test_a_save_in_a_step_that_is_not_lost_runs_and_its_errors_reach_the_script() -> None:
    lost = [False]
    assert wrap(Save(), lost)({}) == "metadata"
    with pytest.raises(OSError):
        wrap(Save(raises=OSError("disk full")), lost)({})


def test_a_save_that_begins_in_a_lost_step_does_nothing() -> None:
    save = Save()
    assert wrap(save, [True])({}) == "stand-in"
    assert save.calls == 0


@pytest.mark.parametrize("error", [ValueError("Failed to validate global plan"), CheckpointException("plan", {})])
def test_a_save_lost_inside_ends_quietly_whatever_torch_raised(error: BaseException) -> None:
    """CheckpointException, which gathers every seat's error, is a BaseException, not an Exception."""
    lost = [False]
    assert wrap(Save(raises=error, loses=lost), lost)({}) == "stand-in"


def test_a_save_without_collectives_or_off_the_training_thread_is_left_alone() -> None:
    """no_dist: DeadPool's own disk checkpoints (written off the training thread too); another thread's save is
    not the step's."""
    save = Save()
    assert wrap(save, [True])({}, None, no_dist=True) == "metadata"
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(wrap(save, [True])({})))
    thread.start()
    thread.join()
    assert results == ["metadata"] and save.calls == 2


def test_async_save_is_refused_with_what_to_use_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own refusal of DeadPool's default group asks for a CPU backend, which misleads: DeadPool's says why."""
    import sys

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.state_dict_saver as saver

    from deadpool.errors import MisuseError
    from deadpool.worker.dcp import enable_once_imported

    for module, name in ((saver, "_save_state_dict"), (loader, "_load_state_dict"), (saver, "async_save"),
                         (dcp, "async_save")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    assert "torch.distributed.checkpoint.state_dict_saver" in sys.modules
    assert enable_once_imported(lambda: False)
    with pytest.raises(MisuseError, match="--checkpoint-dir"):
        dcp.async_save({}, checkpoint_id="unused")
