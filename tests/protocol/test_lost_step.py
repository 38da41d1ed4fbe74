"""A lost step's optimizer step is skipped, without upsetting LR schedulers built before or after the skip; a
mesh seat's model watched by ``AbandonableForward.wrap`` stops a lost step's forward at the next submodule
(the hooks torch's parallel libraries register stand in as pre-hooks registered before DeadPool's)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from deadpool.worker import dtensors
from deadpool.worker.lost_step import AbandonableForward, fill_missing_grads, skip_when_lost


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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)
        self.entered: list[str] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.second(torch.relu(self.first(x)))
        return out, out.sum()


def test_a_lost_forward_stops_before_the_next_submodules_hooks_and_returns_tied_stand_ins() -> None:
    net = Net()
    lost, stopped = [False], []
    for name in ("first", "second"):  # a library's pre-hooks (an all-gather), registered before DeadPool's
        getattr(net, name).register_forward_pre_hook(lambda module, args, name=name: net.entered.append(name))
    AbandonableForward(net, lambda: lost[0], lambda: stopped.append(True)).wrap()
    x = torch.ones(3, 4)
    out, loss = net(x)  # the first call runs whole: its shapes are the template
    assert net.entered == ["first", "second"] and out.shape == (3, 2) and not stopped
    net.entered.clear()
    net.first.register_forward_hook(lambda *_: lost.__setitem__(0, True))  # the Prepare comes in `first`
    out, loss = net(x)
    assert net.entered == ["first"], "the second submodule's hooks never ran"
    assert stopped == [True] and out.shape == (3, 2) and loss.shape == () and float(loss.detach()) == 0.0
    loss.backward()  # tied to a parameter: the script's backward runs, and reaches it
    assert net.first.weight.grad is not None or net.second.weight.grad is not None
    net.entered.clear()
    out, _ = net(x)  # lost from the start: nothing runs, stand-ins at once
    assert net.entered == [] and stopped == [True, True] and out.shape == (3, 2)


def test_after_a_lost_forward_every_parameter_has_a_gradient_for_the_script_to_read() -> None:
    """A script that reads gradients after its backward (a norm, its own all-reduce) finds them in a lost step too."""
    net = Net()
    lost = [False]
    AbandonableForward(net, lambda: lost[0]).wrap()
    x = torch.ones(3, 4)
    net(x)[1].backward()
    for p in net.parameters():
        p.grad = None  # zero_grad(set_to_none=True)
    lost[0] = True
    net(x)[1].backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in net.parameters())
    lost[0] = False
    net.zero_grad(set_to_none=True)
    fill_missing_grads([net, "not a module"])  # what a backward abandoned mid-way leaves (runtime.py)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())


def test_fsdp2s_switches_are_read_and_turned_back_as_a_snapshot_holds_them() -> None:
    """What a pipeline schedule turns off for its microbatches and on at its end: a lost step leaves them off."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        saved = dtensors.fsdp_switches([model, "not a module"])
        assert saved == [[True, True, True, True]] * 2, "the root, then its block: every switch on"
        model.set_requires_gradient_sync(False)
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        assert [row[1:] for row in dtensors.fsdp_switches([model])] == [[False, False, False]] * 2
        dtensors.set_fsdp_switches([model], saved)
        assert dtensors.fsdp_switches([model]) == saved
    finally:
        dist.destroy_process_group()
