"""nn.SyncBatchNorm on CPU through DeadPool's default group: two seats give what one BatchNorm gives on both batches.

Two threads are two seats on a real gloo group (one process, a HashStore); each
seat's ``DefaultGroup`` issues on it and waits.  The reference is a plain
BatchNorm over the concatenated batch: the forward, the running statistics and
the input's gradient must match it, and the seats' (local) weight gradients
must add up to it, as torch's SyncBatchNorm on GPU does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch._C._distributed_c10d import HashStore, ProcessGroupGloo

from deadpool.worker import syncbn
from deadpool.worker.groups.default import DefaultGroup
from deadpool.worker.patches import Patches

SIZES = (3, 5)  # unequal batches: the all-gathered counts must weigh each seat's statistics


class Issuer:
    """A ``UserCollectives`` on a real group, without a runtime: issue, then wait."""

    def __init__(self, group: ProcessGroupGloo) -> None:
        self.group = group

    def issue_user(self, issue: Callable[[Any], Any], point: object) -> Any:
        return issue(self.group)

    def await_user(self, work: Any, what: str) -> bool:
        work.wait()
        return True


def gloo_pair() -> list[ProcessGroupGloo]:
    store = HashStore()
    groups: list[ProcessGroupGloo | None] = [None, None]

    def build(rank: int) -> None:
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=30)
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = ProcessGroupGloo(store, rank, 2, options)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(g is not None for g in groups)
    return [g for g in groups if g is not None]


def test_two_seats_normalize_as_one_batchnorm_over_both_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    inputs = [torch.randn(n, 4, 3, 3) * (1 + i) + i for i, n in enumerate(SIZES)]
    weights = [torch.randn(n, 4, 3, 3) for n in SIZES]  # the loss: a fixed random projection of the output

    reference = nn.BatchNorm2d(4, momentum=0.3)
    nn.init.uniform_(reference.weight)
    nn.init.uniform_(reference.bias)
    whole = torch.cat(inputs).requires_grad_()
    expected_output = reference(whole)
    (expected_output * torch.cat(weights)).sum().backward()

    real = gloo_pair()
    seats = [DefaultGroup(Issuer(group), rank, 2) for rank, group in enumerate(real)]
    monkeypatch.setattr(c10d._world, "default_pg", seats[0])  # torch's SyncBatchNorm syncs only once one exists
    monkeypatch.setattr(nn.SyncBatchNorm, "forward", nn.SyncBatchNorm.forward)  # undone after the test
    monkeypatch.setattr(syncbn, "PATCHES", Patches())  # and the registry that installs it, this test's own
    syncbn.enable()
    results: list[dict[str, Any]] = [{}, {}]

    def run(rank: int) -> None:
        module = nn.SyncBatchNorm(4, momentum=0.3, process_group=seats[rank])
        module.load_state_dict(nn.BatchNorm2d(4).state_dict())
        with torch.no_grad():
            module.weight.copy_(reference.weight)
            module.bias.copy_(reference.bias)
        x = inputs[rank].clone().requires_grad_()
        output = module(x)
        (output * weights[rank]).sum().backward()
        results[rank] = {"output": output.detach(), "grad": x.grad, "module": module}

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(results), "a seat did not finish"

    assert torch.allclose(torch.cat([r["output"] for r in results]), expected_output.detach(), atol=1e-5)
    assert whole.grad is not None
    assert torch.allclose(torch.cat([r["grad"] for r in results]), whole.grad, atol=1e-5)
    for r in results:
        module = r["module"]
        assert torch.allclose(module.running_mean, reference.running_mean, atol=1e-6)
        assert torch.allclose(module.running_var, reference.running_var, atol=1e-6)  # unbiased, as BatchNorm's
        assert module.num_batches_tracked.item() == 1
    weight_grad = sum(r["module"].weight.grad for r in results)
    bias_grad = sum(r["module"].bias.grad for r in results)
    assert reference.weight.grad is not None and reference.bias.grad is not None
    assert torch.allclose(weight_grad, reference.weight.grad, atol=1e-4)
    assert torch.allclose(bias_grad, reference.bias.grad, atol=1e-4)
    assert torch.equal(results[0]["module"].running_var, results[1]["module"].running_var), "identical on every seat"
