"""The global random number generators a snapshot holds: torch's CPU RNG, every CUDA device's, Python's, numpy's.

Dropout, random transforms and data-loader seeds draw from these between steps, so a
restored step must find them exactly as the failure-free run had them.  The states are
plain tensors, numbers and tuples (what a snapshot's state tree may hold).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

UNSEEDED = ("python", "numpy")  # seeded from the OS unless the script seeds them: restored, never digested


def capture() -> dict[str, Any]:
    """The RNG states of this process, for a snapshot."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    assert isinstance(keys, np.ndarray)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()  # one state per device, not only the current one
    return states


def restore(states: dict[str, Any]) -> None:
    """Put back what `capture` returned (a state without numpy's, from an older snapshot, leaves numpy's alone)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])

