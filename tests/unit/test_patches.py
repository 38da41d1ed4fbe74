"""The registry of torch patches: every target exists in the installed torch, and nothing else patches torch."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadpool.worker import patches
from deadpool.worker.patches import CHANGED_ON_OBJECTS, TARGETS, Patches, Target

LIBRARY = Path(__file__).resolve().parents[2] / "deadpool"


@pytest.mark.parametrize("target", TARGETS, ids=[target.name for target in TARGETS])
def test_every_patched_target_exists_in_the_installed_torch(target: Target) -> None:
    importlib.import_module(target.module)  # a lazy target's module too: the script may import it
    assert target.resolve() is not None, target.name
    for alias in target.aliases:
        assert hasattr(importlib.import_module(alias), target.path.rsplit(".", 1)[-1]), (alias, target.name)


@pytest.mark.parametrize("change", CHANGED_ON_OBJECTS, ids=[f"{c.kind}.{c.attribute}" for c in CHANGED_ON_OBJECTS])
def test_every_attribute_changed_on_the_scripts_objects_exists(change: patches.ObjectChange) -> None:
    kind = importlib.import_module(change.module)
    for part in change.kind.split("."):
        kind = getattr(kind, part)
    assert hasattr(kind, change.attribute)


@pytest.fixture
def fake_torch() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    module, alias = types.ModuleType("fake_torch_module"), types.ModuleType("fake_torch_alias")

    class Thing:
        def run(self) -> str:
            return "torch's"

    module.Thing = Thing  # type: ignore[attr-defined]
    module.fn = alias.fn = lambda: "torch's"  # type: ignore[attr-defined]
    sys.modules[module.__name__], sys.modules[alias.__name__] = module, alias
    yield module, alias
    del sys.modules[module.__name__], sys.modules[alias.__name__]


def test_a_patch_is_installed_once_renewed_on_request_and_undone(
    fake_torch: tuple[types.ModuleType, types.ModuleType],
) -> None:
    module, alias = fake_torch
    registry = Patches()
    fn = Target(module.__name__, "fn", "a test", aliases=(alias.__name__,))
    method = Target(module.__name__, "Thing.run", "a test")
    assert registry.install(fn, lambda original: lambda: "first over " + original())
    assert not registry.install(fn, lambda original: lambda: "second"), "once per process"
    assert module.fn() == alias.fn() == "first over torch's"
    assert registry.install(fn, lambda original: lambda: "renewed over " + original(), renew=True)
    assert module.fn() == "renewed over torch's", "a renewal wraps torch's original, not the first patch"
    registry.install(method, lambda original: lambda self: "patched " + original(self))
    assert module.Thing().run() == "patched torch's"
    assert registry.installed(method) and registry.original(method)(module.Thing()) == "torch's"
    registry.undo_all()
    assert module.fn() == alias.fn() == module.Thing().run() == "torch's"
    assert not registry.installed(fn)


def test_a_lazy_patch_waits_for_the_script_to_import_its_module() -> None:
    registry = Patches()
    lazy = Target("fake_torch_never_imported", "fn", "a test", lazy=True)
    assert not registry.install(lazy, lambda original: original)
    assert not registry.installed(lazy)


def _torch_names(tree: ast.Module) -> set[str]:
    """Names a module binds to torch or one of its submodules or classes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_nothing_outside_the_registry_assigns_to_torch() -> None:
    """An assignment to an attribute of something imported from torch (or a setattr on it) is a patch: it belongs
    in ``worker/patches.py``."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        torch_names = _torch_names(tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                targets = node.args[:1]
            for target in targets:
                if _root(target) in torch_names:
                    found.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno}")
    assert not found, f"torch patched outside deadpool/worker/patches.py: {found}"
