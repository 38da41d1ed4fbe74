"""A lost step's optimizer step is skipped, without upsetting LR schedulers built before or after the skip."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from deadpool.worker.lost_step import skip_when_lost


def _setup(scheduler_first: bool) -> tuple[nn.Linear, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                                           dict[str, bool], list[int]]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    flags = {"lost": False}
    stepped: list[int] = []
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        skip_when_lost(opt, lambda: flags["lost"], lambda: stepped.append(1))
    else:
        skip_when_lost(opt, lambda: flags["lost"], lambda: stepped.append(1))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return layer, opt, sched, flags, stepped


def test_a_lost_step_leaves_parameters_and_optimizer_state_untouched() -> None:
    for scheduler_first in (True, False):
        layer, opt, sched, flags, stepped = _setup(scheduler_first)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the scheduler must not warn that step() was overridden or skipped
            layer(torch.randn(3, 4)).sum().backward()
            opt.step()
            sched.step()
        assert stepped == [1]
        before = [p.detach().clone() for p in layer.parameters()]
        state = {k: v.clone() for k, v in opt.state[layer.weight].items()}
        flags["lost"] = True
        layer(torch.randn(3, 4)).sum().backward()
        assert opt.step() is None
        assert stepped == [1], "a skipped step does not count as a step"
        assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
        assert all(torch.equal(v, opt.state[layer.weight][k]) for k, v in state.items())
        flags["lost"] = False
        opt.step()
        assert stepped == [1, 1]
        assert not torch.equal(before[0], layer.weight)
