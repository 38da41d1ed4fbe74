"""Sharded state in snapshots: a seat's snapshot holds the local shards of its DTensors, nothing else.

FSDP2 and tensor parallel make parameters and optimizer state ``DTensor``s.  A snapshot takes
each one's local tensor (a view, no communication), so a seat holds only its own shards and
its buddy a copy of them; a restore wraps the loaded local tensors back into DTensors laid out
like the live object's (its parameters' mesh and placements), then loads them the usual way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch


def _loaded(module: str, name: str) -> Any:
    """`module`'s class `name` if the module has been imported, else None (nothing can be one of its instances).

    Importing DTensor costs about a second of CPU per process (sympy, the sharding rules): a script that makes
    no DTensor (DDP, ZeRO) never pays it, since whatever makes a DTensor or an FSDP module imports it first.
    """
    loaded = sys.modules.get(module)
    return None if loaded is None else getattr(loaded, name, None)


def _is_dtensor(value: object) -> bool:
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(value, dtensor)


def fsdp_resets() -> bool:
    """Whether FSDP2 can be reset after a backward aborted mid-way (``reset_iter_state()``, in torch 2.13).

    A mesh seat abandons a lost step's backward only then, and runs it to its end on a torch without it.
    """
    fsdp = _loaded("torch.distributed.fsdp", "FSDPModule")
    return fsdp is None or hasattr(fsdp, "reset_iter_state")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `tensor`'s values on this seat (its local shard for a DTensor)."""
    return tensor._local_tensor if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def localize(tree: Any) -> Any:
    """`tree` (a state dict) with every DTensor replaced by its local tensor; other values untouched."""
    if _is_dtensor(tree):
        return local(tree)
    if isinstance(tree, dict):
        return {key: localize(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)) and any(_is_dtensor(v) or isinstance(v, (dict, list, tuple)) for v in tree):
        return type(tree)(localize(value) for value in tree)
    return tree


def _like(loaded: Any, live: Any) -> Any:
    if not isinstance(loaded, torch.Tensor) or _is_dtensor(loaded) or loaded.shape != local(live).shape:
        return loaded
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor.from_local(loaded, live.device_mesh, live.placements, run_check=False,
                              shape=live.shape, stride=live.stride())


def _relayout(loaded: Any, live: Any) -> Any:
    if _is_dtensor(live):
        return _like(loaded, live)
    if isinstance(loaded, dict) and isinstance(live, dict):
        return {key: _relayout(value, live[key]) if key in live else value for key, value in loaded.items()}
    if isinstance(loaded, (list, tuple)) and isinstance(live, (list, tuple)) and len(loaded) == len(live):
        return type(loaded)(_relayout(value, ref) for value, ref in zip(loaded, live, strict=True))
    return loaded


def relayout(loaded: Any, obj: Any) -> Any:
    """`loaded` (a localized state dict of `obj`) with DTensors where `obj`'s live state has them.

    An optimizer that has not stepped yet (a spare's) has no state to copy the layout from: its
    per-parameter state takes the layout of the parameter, by the index ``state_dict`` uses.
    """
    live = obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer) and isinstance(loaded, dict) and "state" in loaded:
        params = [p for group in obj.param_groups for p in group["params"]]
        state = {}
        for index, entries in loaded["state"].items():
            param = params[index] if isinstance(index, int) and index < len(params) else None
            if _is_dtensor(param):
                entries = {key: _like(value, param) for key, value in entries.items()}
            state[index] = entries
        return {**loaded, "state": state}
    return _relayout(loaded, live)


def _fsdp_modules(objects: Iterable[object]) -> list[Any]:
    """Every FSDP2 module under the modules among `objects`, in a fixed order (the same on every seat)."""
    fsdp = _loaded("torch.distributed.fsdp", "FSDPModule")
    if fsdp is None:
        return []
    return [module for obj in objects if isinstance(obj, torch.nn.Module)
            for module in obj.modules() if isinstance(module, fsdp)]


def fsdp_switches(objects: Iterable[object]) -> list[list[bool]]:
    """The switches a step turns on the FSDP2 modules among `objects`: per module its ``set_is_last_backward``,
    then per parameter group ``set_requires_gradient_sync`` (reduce, all-reduce) and ``set_reshard_after_backward``.

    They are state between steps like the parameters: a pipeline schedule turns them off for all but its last
    microbatch and on again at its end, so a lost step leaves them off where a finished one leaves them on, and a
    replayed step would then reduce-scatter where its peers do not (a hang).
    """
    switches = []
    for module in _fsdp_modules(objects):
        state = module._get_fsdp_state()
        row = [bool(state._state_ctx.is_last_backward)]
        for group in state._fsdp_param_groups:
            row += [bool(group.reduce_grads), bool(group.all_reduce_grads), bool(group.reshard_after_backward)]
        switches.append(row)
    return switches


def set_fsdp_switches(objects: Iterable[object], switches: list[list[bool]]) -> None:
    """Turn the FSDP2 modules' switches as :func:`fsdp_switches` read them (on any seat of the same script)."""
    for module, row in zip(_fsdp_modules(objects), switches, strict=False):
        state = module._get_fsdp_state()
        state._state_ctx.is_last_backward = row[0]
        for group, i in zip(state._fsdp_param_groups, range(1, len(row), 3), strict=False):
            group.reduce_grads, group.all_reduce_grads, group.reshard_after_backward = row[i:i + 3]


def reset_fsdp_iterations(objects: Iterable[object]) -> None:
    """Clear FSDP2's per-iteration state under every root FSDP module among `objects`.

    A backward abandoned mid-way never reaches FSDP2's final callback, which would otherwise leave the
    next backward without one (its reduce-scatters never finalized) and the parameters unsharded.
    ``reset_iter_state()`` reshards them and drops the lost iteration's gradient reductions.
    """
    if not fsdp_resets():
        return
    for module in _fsdp_modules(objects):
        if module._get_fsdp_state()._is_root:
            module.reset_iter_state()
