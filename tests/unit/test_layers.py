"""The layer rules of the package layout, checked by reading every import with `ast`.

Each folder of `deadpool/` is a room with a direction: protocol and events sit at the bottom,
the worker (compute thread) at the top, and the service side (coordinator, agent, tools) stays
torch-free at import.  These tests walk every .py under `deadpool/`, `transports/` (packaged as
`deadpool.transports`) and `tools/` (packaged as `deadpool.tools`) and fail naming the offending
`file:line` and import.  Every import counts: at module level, inside functions and classes, and
under ``if TYPE_CHECKING:`` (only the torch rule looks at what runs at import time).  The checker
is plain functions so that `test_checker_reports_every_rule` can prove, on a synthetic tree, that
each rule fails when it should.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder of the checkout -> the package it is installed as (pyproject's package-dir)
PACKAGES = {"deadpool": "deadpool", "transports": "deadpool.transports", "tools": "deadpool.tools"}
MAX_LINES = 700

PROTOCOL = "deadpool.protocol"
EVENTS = "deadpool.events"
TRANSPORTS = "deadpool.transports"
SNAPSHOT = "deadpool.snapshot"
ACTORS = "deadpool.actors"
WORKER = "deadpool.worker"
COORDINATOR = "deadpool.coordinator"
AGENT = "deadpool.agent"
TOOLS = "deadpool.tools"
SERVICE_SIDE = (COORDINATOR, AGENT, TOOLS)


@dataclass(frozen=True)
class Import:
    """One imported name, resolved to the module it loads."""

    importer: str  # dotted name of the importing module
    where: str  # "deadpool/protocol/view.py:12", relative to the tree root
    target: str  # the module loaded: `from a.b import c` is a.b.c when that is a module of the tree, else a.b
    statement: str  # the import as written, one name: "from ..actors import handoff"
    level: int  # 0 for an absolute import, the number of leading dots otherwise
    in_function: bool  # inside a def or lambda: runs only when called
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs

    @property
    def runs_on_import(self) -> bool:
        """Executed when the importing module is imported (module or class body, not type-only)."""
        return not (self.in_function or self.type_checking)

    def __str__(self) -> str:
        return f"{self.where}: {self.statement}"


def within(name: str, prefix: str) -> bool:
    """`name` is the module or package `prefix` or lies below it."""
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    """tools/simulate.py -> deadpool.tools.simulate; deadpool/protocol/__init__.py -> deadpool.protocol."""
    folder, *rest = path.relative_to(root).parts
    parts = [*PACKAGES[folder].split("."), *rest]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules(root: Path) -> dict[str, Path]:
    """Every module of the tree under `root`, by dotted name."""
    found: dict[str, Path] = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(root, path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    nodes: list[ast.AST], in_function: bool, type_checking: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function, type_checking
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _import_nodes(list(ast.iter_child_nodes(node)), True, type_checking)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(list(node.body), in_function, True)
            yield from _import_nodes(list(node.orelse), in_function, type_checking)
        else:
            yield from _import_nodes(list(ast.iter_child_nodes(node)), in_function, type_checking)


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name a relative `from` import starts from (PEP 328)."""
    if level == 0:
        return module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 >= len(package):
        raise ValueError(f"relative import beyond the top-level package in {importer}")
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in the file at `path` (a module of the tree under `root`), one entry per name."""
    known = modules(root)
    importer = module_name(root, path)
    is_package = path.name == "__init__.py"
    rel = path.relative_to(root).as_posix()
    found: list[Import] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, in_function, type_checking in _import_nodes(list(tree.body), False, False):
        where = f"{rel}:{node.lineno}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, where, alias.name, f"import {alias.name}", 0, in_function, type_checking))
            continue
        base = _absolute(importer, is_package, node.level, node.module)
        written = "." * node.level + (node.module or "")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            target = sub if sub in known else base
            statement = f"from {written} import {alias.name}"
            found.append(Import(importer, where, target, statement, node.level, in_function, type_checking))
    return found


@functools.cache
def all_imports(root: Path = ROOT) -> tuple[Import, ...]:
    return tuple(imp for path in modules(root).values() for imp in imports_of(path, root))


# --- the rules: each returns one line per violation, "file:line: import: why" ------------------


def bottom_room_violations(root: Path = ROOT) -> list[str]:
    """protocol and events import only deadpool.errors and their own room."""
    problems = []
    for imp in all_imports(root):
        for room in (PROTOCOL, EVENTS):
            if within(imp.importer, room) and within(imp.target, "deadpool"):
                if imp.target != "deadpool.errors" and not within(imp.target, room):
                    problems.append(f"{imp}: {room} may import only deadpool.errors and {room}")
    return problems


def transports_violations(root: Path = ROOT) -> list[str]:
    """transports import only the transport interface (and each other)."""
    return [
        f"{imp}: {TRANSPORTS} may import only deadpool.protocol.transport"
        for imp in all_imports(root)
        if within(imp.importer, TRANSPORTS)
        and within(imp.target, "deadpool")
        and imp.target != "deadpool.protocol.transport"
        and not within(imp.target, TRANSPORTS)
    ]


def snapshot_violations(root: Path = ROOT) -> list[str]:
    return [
        f"{imp}: {SNAPSHOT} must not import {ACTORS} or {WORKER}"
        for imp in all_imports(root)
        if within(imp.importer, SNAPSHOT) and (within(imp.target, ACTORS) or within(imp.target, WORKER))
    ]


def actors_violations(root: Path = ROOT) -> list[str]:
    return [
        f"{imp}: {ACTORS} must not import {WORKER}"
        for imp in all_imports(root)
        if within(imp.importer, ACTORS) and within(imp.target, WORKER)
    ]


def worker_importer_violations(root: Path = ROOT) -> list[str]:
    """Only deadpool/__init__.py (the lazy `init`/`Runtime`) and the worker itself import the worker."""
    return [
        f"{imp}: only deadpool/__init__.py and {WORKER} itself may import {WORKER}"
        for imp in all_imports(root)
        if within(imp.target, WORKER) and imp.importer != "deadpool" and not within(imp.importer, WORKER)
    ]


def service_worker_violations(root: Path = ROOT) -> list[str]:
    return [
        f"{imp}: coordinator, agent and tools must not import {WORKER}"
        for imp in all_imports(root)
        if any(within(imp.importer, side) for side in SERVICE_SIDE) and within(imp.target, WORKER)
    ]


def service_importer_violations(root: Path = ROOT) -> list[str]:
    """The coordinator and the agent are processes of their own: only the tools (the CLI) import them."""
    problems = []
    for imp in all_imports(root):
        for side in (COORDINATOR, AGENT):
            if within(imp.target, side) and not within(imp.importer, side) and not within(imp.importer, TOOLS):
                problems.append(f"{imp}: only {side} itself and {TOOLS} may import {side}")
    return problems


def service_torch_violations(root: Path = ROOT) -> list[str]:
    """Module-level torch imports on the service side (inside functions and TYPE_CHECKING is fine)."""
    return [
        f"{imp}: coordinator, agent and tools must not import torch when imported (import it inside the function)"
        for imp in all_imports(root)
        if any(within(imp.importer, side) for side in SERVICE_SIDE)
        and within(imp.target, "torch")
        and imp.runs_on_import
    ]


def _import_time_closure(root: Path, start: str) -> dict[str, tuple[str, Import | None]]:
    """Modules loaded when `start` is imported: module -> (who loaded it, the import).  Parent packages count."""
    by_importer: dict[str, list[Import]] = {}
    for imp in all_imports(root):
        if imp.runs_on_import:
            by_importer.setdefault(imp.importer, []).append(imp)
    known = modules(root)
    reached: dict[str, tuple[str, Import | None]] = {start: ("", None)}
    queue = [start]
    while queue:
        current = queue.pop()
        parts = current.split(".")
        parents = [".".join(parts[:n]) for n in range(1, len(parts))]
        steps: list[tuple[str, Import | None]] = [(p, None) for p in parents if p in known]
        steps += [(imp.target, imp) for imp in by_importer.get(current, [])]
        for target, imp in steps:
            if target not in reached:
                reached[target] = (current, imp)
                if target in known:
                    queue.append(target)
    return reached


def service_torch_closure_violations(root: Path = ROOT) -> list[str]:
    """No service-side module loads torch at import time through another deadpool module either."""
    problems = []
    for name in modules(root):
        if not any(within(name, side) for side in SERVICE_SIDE):
            continue
        reached = _import_time_closure(root, name)
        torch = sorted(t for t in reached if within(t, "torch"))
        if not torch:
            continue
        chain, node = [], torch[0]
        while node != name:
            parent, imp = reached[node]
            chain.append(f"{node} ({imp if imp else 'parent package'})")
            node = parent
        problems.append(f"importing {name} loads torch: {name} -> " + " -> ".join(reversed(chain)))
    return problems


def service_snapshot_violations(root: Path = ROOT) -> list[str]:
    """The agent may use deadpool.snapshot.shm; the coordinator and tools import no snapshot module."""
    problems = []
    for imp in all_imports(root):
        if not within(imp.target, SNAPSHOT):
            continue
        if within(imp.importer, AGENT) and imp.target != "deadpool.snapshot.shm":
            problems.append(f"{imp}: {AGENT} may import only deadpool.snapshot.shm from {SNAPSHOT}")
        elif within(imp.importer, COORDINATOR) or within(imp.importer, TOOLS):
            problems.append(f"{imp}: {COORDINATOR} and {TOOLS} must not import {SNAPSHOT}")
    return problems


def tools_importer_violations(root: Path = ROOT) -> list[str]:
    """Nothing in deadpool/ imports deadpool.tools except deadpool/__main__.py (`python -m deadpool`).

    The transports are held to the stricter transports rule.
    """
    return [
        f"{imp}: only deadpool/__main__.py may import {TOOLS}"
        for imp in all_imports(root)
        if within(imp.target, TOOLS)
        and not within(imp.importer, TOOLS)
        and not within(imp.importer, TRANSPORTS)
        and imp.importer != "deadpool.__main__"
    ]


def tools_absolute_violations(root: Path = ROOT) -> list[str]:
    """Inside tools/, siblings are imported relatively: mypy cannot map deadpool.tools to the tools/ folder."""
    return [
        f"{imp}: import sibling tools modules relatively (from . import x)"
        for imp in all_imports(root)
        if within(imp.importer, TOOLS) and within(imp.target, TOOLS) and imp.level == 0
    ]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component that has one (Tarjan, then BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # the tree is small: recursion depth is bounded by its module count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph.get(start, ()):
            continue
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            nxt = []
            for node in frontier:
                for succ in sorted(graph.get(node, ()) & component):
                    if succ not in came_from:
                        came_from[succ] = node
                        nxt.append(succ)
            frontier = nxt
        path, node = [start], came_from[start]
        while node != start:
            path.append(node)
            node = came_from[node]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def cycle_violations(root: Path = ROOT) -> list[str]:
    """Import cycles among the tree's modules; TYPE_CHECKING and function-level imports count too."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    first_edge: dict[tuple[str, str], Import] = {}
    for imp in all_imports(root):
        if imp.target in known:
            graph[imp.importer].add(imp.target)
            first_edge.setdefault((imp.importer, imp.target), imp)
    return [
        "import cycle " + " -> ".join(cycle) + ": " + "; ".join(str(first_edge[a, b]) for a, b in zip(cycle, cycle[1:]))
        for cycle in _cycles(graph)
    ]


def size_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for path in modules(root).values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            problems.append(f"{path.relative_to(root).as_posix()}: {lines} lines, over {MAX_LINES}: split it")
    return problems


RULES: dict[str, Callable[[Path], list[str]]] = {
    "bottom": bottom_room_violations,
    "transports": transports_violations,
    "snapshot": snapshot_violations,
    "actors": actors_violations,
    "worker_importers": worker_importer_violations,
    "service_worker": service_worker_violations,
    "service_importers": service_importer_violations,
    "service_torch": service_torch_violations,
    "service_torch_closure": service_torch_closure_violations,
    "service_snapshot": service_snapshot_violations,
    "tools_importers": tools_importer_violations,
    "tools_absolute": tools_absolute_violations,
    "cycles": cycle_violations,
    "sizes": size_violations,
}


def _check(rule: Callable[[Path], list[str]]) -> None:
    problems = rule(ROOT)
    assert not problems, f"{len(problems)} layer violation(s):\n" + "\n".join(problems)


# --- the rules on the real tree ----------------------------------------------------------------


def test_the_walk_sees_every_room() -> None:
    names = modules(ROOT)
    for room in (PROTOCOL, EVENTS, TRANSPORTS, SNAPSHOT, ACTORS, WORKER, COORDINATOR, AGENT, TOOLS):
        assert room in names, f"{room} not found under {ROOT}"
    assert "deadpool.transports.inproc" in names and "deadpool.tools.cli" in names
    assert any(imp.target == "deadpool.errors" for imp in all_imports(ROOT))


def test_protocol_and_events_import_only_errors_and_their_own_room() -> None:
    _check(bottom_room_violations)


def test_transports_import_only_the_transport_interface() -> None:
    _check(transports_violations)


def test_snapshot_imports_neither_actors_nor_worker() -> None:
    _check(snapshot_violations)


def test_actors_do_not_import_the_worker() -> None:
    _check(actors_violations)


def test_only_the_package_root_imports_the_worker() -> None:
    _check(worker_importer_violations)


def test_coordinator_agent_and_tools_do_not_import_the_worker() -> None:
    _check(service_worker_violations)


def test_only_the_tools_import_the_coordinator_and_the_agent() -> None:
    _check(service_importer_violations)


def test_coordinator_agent_and_tools_import_no_torch_at_module_level() -> None:
    _check(service_torch_violations)


def test_coordinator_agent_and_tools_load_no_torch_through_other_modules() -> None:
    _check(service_torch_closure_violations)


def test_only_the_agent_uses_snapshot_and_only_shm() -> None:
    _check(service_snapshot_violations)


def test_only_main_imports_the_tools() -> None:
    _check(tools_importer_violations)


def test_tools_import_their_siblings_relatively() -> None:
    _check(tools_absolute_violations)


def test_no_import_cycles() -> None:
    _check(cycle_violations)


def test_no_module_over_700_lines() -> None:
    _check(size_violations)


# --- the checker can fail ----------------------------------------------------------------------

SYNTHETIC = {
    "deadpool/__init__.py": """
        from typing import TYPE_CHECKING
        from deadpool.errors import DeadPoolError
        if TYPE_CHECKING:
            from deadpool.worker.runtime import Runtime  # allowed: the package root
    """,
    "deadpool/__main__.py": "from deadpool.tools.cli import main  # allowed\n",
    "deadpool/errors.py": "class DeadPoolError(Exception): ...\n",
    "deadpool/config.py": """
        def load():
            from deadpool.tools import cli  # BAD tools_importers
    """,
    "deadpool/protocol/__init__.py": "",
    "deadpool/protocol/view.py": """
        from deadpool.errors import DeadPoolError  # allowed
        from . import codec  # allowed: own room
        def f():
            from deadpool.worker.runtime import Runtime  # BAD bottom worker_importers
    """,
    "deadpool/protocol/codec.py": "import msgpack  # allowed: not deadpool\n",
    "deadpool/protocol/transport.py": "",
    "deadpool/events/__init__.py": "",
    "deadpool/events/log.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from deadpool.config import Config  # BAD bottom
        else:
            import json
    """,
    "transports/__init__.py": "",
    "transports/zmq.py": """
        from deadpool.protocol.transport import Frame  # allowed
        from . import inproc  # allowed: own room
        from deadpool.protocol import codec  # BAD transports
    """,
    "transports/inproc.py": "",
    "deadpool/snapshot/__init__.py": "",
    "deadpool/snapshot/shm.py": "import torch  # the agent's closure reaches it\n",
    "deadpool/snapshot/statetree.py": "",
    "deadpool/snapshot/store.py": "from ..actors import handoff  # BAD snapshot\n",
    "deadpool/actors/__init__.py": "",
    "deadpool/actors/handoff.py": "from deadpool.snapshot import statetree  # allowed\n",
    "deadpool/actors/membership.py": "import deadpool.worker.ddp  # BAD actors worker_importers\n",
    "deadpool/worker/__init__.py": "",
    "deadpool/worker/runtime.py": """
        from . import ddp
        from deadpool.coordinator.decisions import DISK  # BAD service_importers
    """,
    "deadpool/worker/ddp.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from deadpool.worker.runtime import Runtime  # cycle runtime <-> ddp
    """,
    "deadpool/coordinator/__init__.py": "",
    "deadpool/coordinator/decisions.py": "",
    "deadpool/coordinator/service.py": """
        import torch  # BAD service_torch service_torch_closure
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import torch.nn  # allowed: never runs
        def serve():
            import torch.distributed  # allowed: runs when called
        class Store:
            import torch.cuda  # BAD service_torch (a class body runs on import)
        from deadpool.snapshot import store  # BAD service_snapshot
    """,
    "deadpool/agent/__init__.py": "",
    "deadpool/agent/launch.py": """
        from deadpool.snapshot import shm  # allowed; BAD service_torch_closure (shm imports torch)
        from deadpool.snapshot.statetree import StateTree  # BAD service_snapshot
        def run():
            from deadpool.worker import runtime  # BAD worker_importers service_worker
    """,
    "tools/__init__.py": "",
    "tools/cli.py": """
        from . import timeline  # allowed
        from deadpool.tools import timeline as again  # BAD tools_absolute
        import deadpool.tools.timeline  # BAD tools_absolute
    """,
    "tools/timeline.py": "from .cli import main  # cycle cli <-> timeline\n",
    "deadpool/long.py": "x = 1\n" * MAX_LINES,
    "deadpool/longer.py": "x = 1  # BAD sizes\n" + "x = 1\n" * MAX_LINES,
}


def _write_tree(root: Path) -> None:
    for rel, text in SYNTHETIC.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")


def _expected(root: Path, rule: str) -> list[str]:
    """file:line of every line the synthetic tree marks `# BAD ... <rule> ...`."""
    marked = []
    for rel in SYNTHETIC:
        for number, line in enumerate((root / rel).read_text(encoding="utf-8").splitlines(), 1):
            if "# BAD" in line and rule in line.split("# BAD", 1)[1].split():
                marked.append(f"{rel}:{number}")
    return sorted(marked)


def _located(problems: list[str]) -> list[str]:
    return sorted(problem.split(": ", 1)[0] for problem in problems)


@pytest.mark.parametrize(
    "rule",
    [
        "bottom",
        "transports",
        "snapshot",
        "actors",
        "worker_importers",
        "service_worker",
        "service_importers",
        "service_torch",
        "service_snapshot",
        "tools_importers",
        "tools_absolute",
    ],
)
def test_checker_reports_every_rule(tmp_path: Path, rule: str) -> None:
    _write_tree(tmp_path)
    expected = _expected(tmp_path, rule)
    assert expected, f"the synthetic tree marks no violation of {rule}"
    problems = RULES[rule](tmp_path)
    assert _located(problems) == expected, "\n".join(problems)


def test_checker_reports_sizes(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    assert size_violations(tmp_path) == [f"deadpool/longer.py: {MAX_LINES + 1} lines, over {MAX_LINES}: split it"]


def test_checker_resolves_and_classifies_imports(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    found = {imp.statement: imp for imp in imports_of(tmp_path / "deadpool/coordinator/service.py", tmp_path)}
    assert found["from deadpool.snapshot import store"].target == "deadpool.snapshot.store"
    assert found["import torch"].runs_on_import
    assert found["import torch.nn"].type_checking and not found["import torch.nn"].runs_on_import
    assert found["import torch.distributed"].in_function and not found["import torch.distributed"].runs_on_import
    assert found["import torch.cuda"].runs_on_import
    relative = {imp.statement: imp for imp in imports_of(tmp_path / "deadpool/snapshot/store.py", tmp_path)}
    assert relative["from ..actors import handoff"].target == "deadpool.actors.handoff"
    tools = {imp.statement: imp for imp in imports_of(tmp_path / "tools/timeline.py", tmp_path)}
    assert tools["from .cli import main"].target == "deadpool.tools.cli"
    assert tools["from .cli import main"].importer == "deadpool.tools.timeline"
    package = {imp.statement: imp for imp in imports_of(tmp_path / "transports/zmq.py", tmp_path)}
    assert package["from . import inproc"].target == "deadpool.transports.inproc"


def test_checker_reports_torch_loaded_through_another_module(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    problems = service_torch_closure_violations(tmp_path)
    loaders = sorted(problem.split(" loads torch", 1)[0].removeprefix("importing ") for problem in problems)
    assert loaders == ["deadpool.agent.launch", "deadpool.coordinator.service"]
    (agent,) = (p for p in problems if p.startswith("importing deadpool.agent.launch"))
    assert "deadpool.snapshot.shm (deadpool/agent/launch.py:1: from deadpool.snapshot import shm)" in agent
    assert "torch (deadpool/snapshot/shm.py:1: import torch)" in agent


def test_checker_reports_cycles_with_their_imports(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    assert cycle_violations(tmp_path) == [
        "import cycle deadpool.tools.cli -> deadpool.tools.timeline -> deadpool.tools.cli: "
        "tools/cli.py:1: from . import timeline; tools/timeline.py:1: from .cli import main",
        "import cycle deadpool.worker.ddp -> deadpool.worker.runtime -> deadpool.worker.ddp: "
        "deadpool/worker/ddp.py:3: from deadpool.worker.runtime import Runtime; "
        "deadpool/worker/runtime.py:1: from . import ddp",
    ]


def test_cycle_search_finds_a_longer_cycle_and_ignores_a_dag() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert _cycles({"a": {"a"}}) == [["a", "a"]]
