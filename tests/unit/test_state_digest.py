"""The final state digest: equal states hash equal, and every bit, shape and key counts."""

from __future__ import annotations

import torch

from deadpool.snapshot.statetree import state_digest


def state() -> dict[str, object]:
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)},
            "step": 4, "groups": [{"lr": 0.1}]}


def test_equal_states_have_equal_digests_whatever_their_memory_layout() -> None:
    other = state()
    other["model"]["w"] = other["model"]["w"].t().contiguous().t()  # type: ignore[index]  # same values, strided
    assert state_digest(state()) == state_digest(other)


def test_one_flipped_bit_a_reshape_or_a_changed_value_changes_the_digest() -> None:
    base = state_digest(state())
    flipped = state()
    flipped["model"]["w"].view(torch.int32)[0, 0] ^= 1  # type: ignore[index]  # the lowest mantissa bit
    reshaped = state()
    reshaped["model"]["w"] = reshaped["model"]["w"].reshape(3, 2)  # type: ignore[index]  # same bytes
    hyper = state()
    hyper["groups"] = [{"lr": 0.2}]
    assert len({base, state_digest(flipped), state_digest(reshaped), state_digest(hyper)}) == 4
