"""A pipeline schedule sets its stages up again in its first step after every rebuild, and a set-up that a failure
interrupts ends the lost step's schedule quietly (worker/pipelining.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn

from deadpool.worker import pipelining
from deadpool.worker.patches import PIPELINE_SET_UP, Patches


class Base:
    """torch's ``_PipelineSchedule`` as far as the patch sees it: what its set-up was told."""

    def _initialize_pp_stages(self, stages: Any, args: Any, kwargs: Any, target: Any, fwd_initialized: bool,
                              bwd_initialized: bool, loss_kwargs: Any = None) -> tuple[bool, bool]:
        self.told.append((fwd_initialized, bwd_initialized))
        if self.loses is not None:  # the step is lost inside: a vote completed locally
            self.loses.lost = True
        if self.set_up_fails:
            raise RuntimeError("Expected _StageForwardMeta from P2P, got NoneType.")  # what torch raises
        return True, True


class Single(Base):
    """``PipelineScheduleSingle``: keeps the flags, and its ``step`` sets up and then runs."""

    def __init__(self) -> None:
        self.told: list[tuple[bool, bool]] = []
        self.flags = (False, False)
        self.set_up_fails = False
        self.loses: Seat | None = None
        self.ran = 0
        self._stage = types.SimpleNamespace(submod=nn.Linear(2, 2))

    def step(self) -> str:
        self.flags = self._initialize_pp_stages([], (), None, None, *self.flags)
        self.ran += 1
        return "outputs"


class Multi(Single):
    """``PipelineScheduleMulti``: a step of its own, patched beside the single-stage one's."""

    def step(self) -> str:
        return super().step()


class Seat:
    def __init__(self) -> None:
        self.lost = False
        self.abandoned = 0

    def step_lost(self) -> bool:
        return self.lost

    def abandon_forward(self) -> None:
        self.abandoned += 1


@pytest.fixture
def schedules(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType(PIPELINE_SET_UP.module)
    module._PipelineSchedule = Base  # type: ignore[attr-defined]
    module.PipelineScheduleSingle = Single  # type: ignore[attr-defined]
    module.PipelineScheduleMulti = Multi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, PIPELINE_SET_UP.module, module)
    monkeypatch.setattr(pipelining, "PATCHES", Patches())  # this test's patches, undone with its classes
    monkeypatch.setattr(Base, "_initialize_pp_stages", Base._initialize_pp_stages)
    monkeypatch.setattr(Single, "step", Single.step)
    monkeypatch.setattr(Multi, "step", Multi.step)
    monkeypatch.setattr(pipelining, "_seat", None)
    yield module


def test_schedules_set_up_again_after_a_rebuild_and_only_then(schedules: types.ModuleType) -> None:
    seat = Seat()
    before = Single()
    before.step()  # stepped before torch's class was patched (the script imported it late)
    pipelining.rebuilt(seat)
    pipelining.rebuilt(seat)  # patched once
    before.step()
    assert before.told == [(False, False), (False, False)], "set up again: the groups were rebuilt since"
    fresh = Single()
    fresh.step()
    fresh.step()
    before.step()
    assert fresh.told == [(False, False), (True, True)] and before.told[-1] == (True, True)
    pipelining.rebuilt(seat)  # a spare took a seat: every seat's schedules set up again, together
    fresh.step()
    before.step()
    assert fresh.told[-1] == (False, False) and before.told[-1] == (False, False)


def test_a_set_up_in_a_lost_step_ends_the_schedules_step_quietly(schedules: types.ModuleType) -> None:
    seat = Seat()
    pipelining.rebuilt(seat)
    schedule = Single()
    seat.lost = True
    assert schedule.step() is None and schedule.told == [], "no set-up begins in a lost step"
    assert schedule.ran == 0 and seat.abandoned == 1
    assert all(p.grad is not None and not p.grad.any() for p in schedule._stage.submod.parameters())
    seat.lost, schedule.set_up_fails = False, True
    with pytest.raises(RuntimeError, match="P2P"):  # not lost: torch's error is the script's
        schedule.step()
    schedule.set_up_fails = False
    assert schedule.step() == "outputs" and schedule.ran == 1
    seat.lost = True
    assert schedule.step() == "outputs", "set up already: the lost step runs on, its collectives completing locally"
    pipelining.rebuilt(seat)
    seat.lost, schedule.loses, schedule.set_up_fails = False, seat, True  # torch's check fails on the stand-in
    assert schedule.step() is None and seat.abandoned == 2
    seat.lost, schedule.set_up_fails = False, False
    assert schedule.step() is None and seat.abandoned == 3, "set up on stand-ins: ends the lost step too"
    seat.lost, schedule.loses = False, None
    assert schedule.step() == "outputs" and schedule.told[-1] == (False, False), "set up again in the replay"
