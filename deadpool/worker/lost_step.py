"""A lost step ends early and changes nothing that a rollback would have to undo.

Once a step is lost (a collective failed, or a Prepare interrupted it), nothing
it computes counts: the view change rolls every seat back and the step is
replayed.  Two things make that cheap.  An optimizer's ``step()`` in a lost
step is skipped, so parameters and optimizer state keep the values they had
after the last finished step, and a survivor resuming from that very step
reloads only the small state its step did change (RNGs, scheduler, buffers,
data position; ``Recovery`` checks that the condition holds).  And the rest
of a lost backward is abandoned: DeadPool's gradient hooks raise
``StepAbandoned``, which autograd carries out of the engine and the wrapper
installed around ``torch.autograd.backward`` swallows, so ``loss.backward()``
returns at once instead of computing gradients nobody will use.  On a mesh
(``rt.device_mesh``) the backward stops at its first collective when the step
is already lost by then (``groups/mesh.py``).  A lost step's forward under ``rt.ddp``,
or of a mesh seat's tracked model, stops too, at the next submodule, and hands
the script stand-ins shaped like the module's last output for inputs of the
same shapes (``AbandonableForward``).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from deadpool.worker.patches import AUTOGRAD_BACKWARD, PATCHES


class StepAbandoned(Exception):
    """Raised inside a lost step's backward to stop it; never reaches the script (``abandonable_backward``)."""


def skip_when_lost(optimizer: torch.optim.Optimizer, lost: Callable[[], bool], stepped: Callable[[], None]) -> None:
    """Make `optimizer`'s ``step()`` do nothing (return None) while `lost()`; `stepped()` runs before a real one.

    The wrapper is a bound method carrying the attributes of the ``step`` it wraps, so an LR
    scheduler built before or after it still finds what it looks for (``_wrapped_by_lr_sched``,
    ``__func__``).
    """
    inner = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if lost():
            return None
        stepped()
        return inner(*args, **kwargs)

    functools.update_wrapper(step, getattr(inner, "__func__", inner))
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def fill_missing_grads(objects: Iterable[object]) -> None:
    """Give each parameter that requires grad, of every module among `objects`, zeros as its gradient where a lost
    step left it none (a backward abandoned or run on stand-ins): a script that reads gradients after its backward
    (a norm to log, an all-reduce of its own) finds them as in any step; their values never count."""
    with torch.no_grad():
        for obj in objects:
            for param in obj.parameters() if isinstance(obj, nn.Module) else ():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)


class AbandonableBackward:
    """``torch.autograd.backward``, which returns quietly when DeadPool abandons a lost step's backward.

    ``Tensor.backward`` calls ``torch.autograd.backward`` by name, so replacing that name covers
    ``loss.backward()`` and GradScaler's scaled backward alike.  Installed once per process.
    `abandoned()` runs once a backward was abandoned, before it returns (FSDP2's per-iteration state is
    reset there: the abandoned backward never reached its final callback).
    """

    def __init__(self, abandoned: Callable[[], None] | None = None) -> None:
        self._abandoned = abandoned

    def install(self) -> None:
        """This runtime's backward is the process's (the newest runtime's, where a test makes several)."""
        PATCHES.install(AUTOGRAD_BACKWARD, self._abandonable, renew=True)

    def uninstall(self) -> None:
        PATCHES.undo(AUTOGRAD_BACKWARD)

    def _abandonable(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except StepAbandoned:
                if self._abandoned is not None:
                    self._abandoned()
                return None

        return backward


PLAIN = (int, float, bool, str, bytes, type(None))  # non-tensor leaves a signature or a stand-in keeps by value
MAX_TEMPLATES = 8  # input signatures remembered (one per shape of batch, in practice)


@dataclass(frozen=True, slots=True)
class TensorShape:
    """What a stand-in copies of a tensor: never its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def signature(tree: Any) -> Hashable | None:
    """The structure of `tree` with its tensors' shapes and its plain values; None if a leaf is neither."""
    leaves, spec = pytree.tree_flatten(tree)
    shapes: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shapes.append(TensorShape(tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, PLAIN):
            shapes.append((type(leaf), leaf))
        else:
            return None
    return spec, tuple(shapes)


def _compiled(module: nn.Module) -> bool:
    """`module` is compiled: torch.compile's wrapper (whose module is imported only once something was compiled),
    or compiled in place (``module.compile()``, which compiles its ``__call__``, hooks included)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


class AbandonableForward:
    """Runs a module's forward so that a lost step stops it at the next submodule it enters.

    The script still gets an output: stand-ins shaped like the output of the last forward with inputs of the
    same shapes and plain values (zeros, tied to one parameter so that the backward reaches a gradient hook
    and is abandoned there as in any lost step).  A forward whose inputs were never seen, or whose input or
    output holds something other than tensors and plain values, runs whole, and so does a compiled one.
    Values of a lost step never count: the step is rolled back and replayed, so only its shapes matter to
    the script.
    """

    def __init__(self, module: nn.Module, lost: Callable[[], bool],
                 stopped: Callable[[], None] | None = None) -> None:
        self._lost = lost
        self._stopped = stopped  # told when a lost step's forward stops (or is not run) and stand-ins go back
        self._armed = False
        self._templates: dict[Hashable, tuple[list[TensorShape | Any], pytree.TreeSpec]] = {}
        self._module = module
        self._anchor = next((p for p in module.parameters() if p.requires_grad and p.numel()), None)
        # A module compiled already runs its lost forward whole (its hooks would be traced into it); one compiled
        # later finds its hooks doing nothing under compilation (`_check`).
        self._hooked = not any(_compiled(sub) for sub in module.modules())
        for sub in module.modules() if self._hooked else ():
            sub.register_forward_pre_hook(self._check, prepend=True)  # before FSDP2's all-gather, TP's hooks

    def _check(self, module: nn.Module, args: Any) -> None:
        # Traced into a compiled region (a submodule compiled after the hook was registered, or a function
        # compiled around the module), the hook is nothing: dynamo would otherwise guard on the flags below and,
        # in a lost step, trace the raise, give up on the frame and run it eagerly from then on (the survivors
        # would then compute what the replacement, running the compiled code, does not).
        if torch.compiler.is_compiling():
            return
        if self._armed and self._lost():
            raise StepAbandoned

    def __call__(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Compiled (a module inside, or torch.compile tracing this call from outside: it would trace the stand-in
        # too, and fail on it), or a call inside the forward being watched: run it whole.
        if not self._hooked or self._armed or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        key = signature((args, kwargs, torch.is_grad_enabled(), self._module.training))
        template = self._templates.get(key) if key is not None else None
        if template is None:  # nothing to stand in for it: run it whole
            return self._remember(key, forward(*args, **kwargs))
        if self._lost():
            return self._stand_in(*template)
        self._armed = True
        try:
            output = forward(*args, **kwargs)
        except StepAbandoned:
            return self._stand_in(*template)
        finally:
            self._armed = False
        return self._remember(key, output)

    def wrap(self) -> None:
        """Watch every call of the module itself (``rt.track`` of a mesh seat's model): its ``forward`` becomes
        an attribute of the instance that runs the class's through this guard, inside torch's hooks."""
        forward = self._module.forward

        @functools.wraps(forward)
        def watched(*args: Any, **kwargs: Any) -> Any:
            return self(forward, *args, **kwargs)

        self._module.forward = watched  # type: ignore[method-assign]

    def _remember(self, key: Hashable | None, output: Any) -> Any:
        if key is None:
            return output
        leaves, spec = pytree.tree_flatten(output)
        if not all(isinstance(leaf, (torch.Tensor, *PLAIN)) for leaf in leaves):
            return output
        if key not in self._templates and len(self._templates) >= MAX_TEMPLATES:
            self._templates.pop(next(iter(self._templates)))
        self._templates[key] = ([TensorShape(tuple(t.shape), t.dtype, t.device, t.requires_grad)
                                 if isinstance(t, torch.Tensor) else t for t in leaves], spec)
        return output

    def _stand_in(self, leaves: list[TensorShape | Any], spec: pytree.TreeSpec) -> Any:
        if self._stopped is not None:
            self._stopped()
        fill_missing_grads([self._module])  # the backward of a stand-in reaches one parameter at most
        anchor = self._anchor
        if anchor is not None and hasattr(anchor, "to_local"):  # a DTensor: its local shard, with no collective
            anchor = anchor.to_local()
        made = []
        for leaf in leaves:
            if not isinstance(leaf, TensorShape):
                made.append(leaf)
                continue
            tensor = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            if leaf.requires_grad and anchor is not None and anchor.numel():
                tensor = tensor + anchor.reshape(-1)[0].to(leaf.device, leaf.dtype) * 0  # tied to a parameter
            elif leaf.requires_grad:
                tensor.requires_grad_()
            made.append(tensor)
        return pytree.tree_unflatten(made, spec)
