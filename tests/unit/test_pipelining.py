"""A pipeline schedule sets its stages up again in its first step after every rebuild (worker/pipelining.py)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from deadpool.worker import pipelining


class Schedule:
    """torch's ``_PipelineSchedule`` as far as the patch sees it: what its set-up was told."""

    def __init__(self) -> None:
        self.told: list[tuple[bool, bool]] = []
        self.flags = (False, False)

    def _initialize_pp_stages(self, stages: Any, args: Any, kwargs: Any, target: Any, fwd_initialized: bool,
                              bwd_initialized: bool, loss_kwargs: Any = None) -> tuple[bool, bool]:
        self.told.append((fwd_initialized, bwd_initialized))
        return True, True

    def step(self) -> None:  # as torch's schedules keep the flags
        self.flags = self._initialize_pp_stages([], (), None, None, *self.flags)


def test_schedules_set_up_again_after_a_rebuild_and_only_then(monkeypatch: pytest.MonkeyPatch) -> None:
    before = Schedule()
    before.step()  # stepped before torch's class was patched (the script imported it late)
    module = types.ModuleType(pipelining._SCHEDULES)
    module._PipelineSchedule = Schedule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, pipelining._SCHEDULES, module)
    monkeypatch.setattr(Schedule, "_initialize_pp_stages", Schedule._initialize_pp_stages)
    pipelining.rebuilt()
    pipelining.rebuilt()  # patched once
    before.step()
    assert before.told == [(False, False), (False, False)], "set up again: the groups were rebuilt since"
    fresh = Schedule()
    fresh.step()
    fresh.step()
    before.step()
    assert fresh.told == [(False, False), (True, True)] and before.told[-1] == (True, True)
    pipelining.rebuilt()  # a spare took a seat: every seat's schedules set up again, together
    fresh.step()
    before.step()
    assert fresh.told[-1] == (False, False) and before.told[-1] == (False, False)
