"""The dependency direction of docs/architecture.md, enforced: a package imports only packages of
lower layers, and no module imports itself back through others (no import cycle).

Every import counts: top-level, lazy (inside a function) and `if TYPE_CHECKING:` alike, because
each one is a dependency a reader has to follow. Parsed with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("areal_jobs", "launch", "bench")

# Lowest first. A unit (a subpackage of areal_jobs, a top-level module of areal_jobs, or a whole
# top-level package) may import units of lower layers only, never one of its own layer or above.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundations",
        {
            "areal_jobs",  # the package docstring only
            "areal_jobs.config",
            "areal_jobs.api",
            "areal_jobs.logs",
            "areal_jobs.metrics",
            "areal_jobs.report",
            "areal_jobs.checkpoint",
            "areal_jobs.samples",
            "areal_jobs.atomic",
        },
    ),
    ("transport", {"areal_jobs.transport"}),
    ("components", {"areal_jobs.data", "areal_jobs.reward", "areal_jobs.weights"}),
    # episodes: workflows, tools and the OpenAI-compatible endpoint, run inside the controller
    ("agent", {"areal_jobs.agent"}),
    ("roles", {"areal_jobs.rollout", "areal_jobs.trainer"}),
    ("launch", {"launch"}),
    ("bench", {"bench"}),
]
# Imports inside one layer that are part of the design, each with its reason.
SIDEWAYS = {
    ("areal_jobs.report", "areal_jobs.metrics"): "the end-of-run summary reads the metrics sink's rows",
    (
        "areal_jobs.data",
        "areal_jobs.reward",
    ): "the countdown warm start scores itself with the task's verifier",
    (
        "areal_jobs.checkpoint",
        "areal_jobs.atomic",
    ): "a checkpoint's meta.json and `latest` are replaced atomically",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "areal_jobs" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of ours in `path`, wherever it sits in the file."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if is_module(target) else base))
    return sorted({(line, name) for line, name in found if name.split(".")[0] in ROOTS})


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}


def layer_index() -> dict[str, int]:
    return {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def test_every_unit_has_a_layer():
    layers = layer_index()
    unplaced = sorted({unit_of(m) for m in all_modules()} - set(layers))
    assert unplaced == [], f"place these in a layer of LAYERS and in docs/architecture.md: {unplaced}"


def test_imports_go_down_the_layers_only():
    layers = layer_index()
    wrong = []
    for module, path in all_modules().items():
        source = unit_of(module)
        for line, target in imports_of(path):
            dest = unit_of(target)
            if dest == source or (source, dest) in SIDEWAYS or layers[dest] < layers[source]:
                continue
            where = "its own layer" if layers[dest] == layers[source] else "a higher layer"
            wrong.append(
                f"{path.relative_to(REPO)}:{line} imports {target} from {where} "
                f"({LAYERS[layers[source]][0]} -> {LAYERS[layers[dest]][0]})"
            )
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycles():
    modules = all_modules()
    graph = {m: sorted({t for _, t in imports_of(p) if t in modules and t != m}) for m, p in modules.items()}
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == [], f"modules that import each other (directly or through others): {cycles}"


# Rooms inside a unit (docs/architecture.md, "Rooms"): lowest first; a room imports rooms below it
# (and the unit's top-level modules listed as shared), never one beside or above it.
ROOMS: dict[str, list[set[str]]] = {
    # the commands at launch/'s top level only hand over to a room; nothing imports them
    "launch": [
        {"launch.planning", "launch.evaluation"},
        {"launch.slurm"},
        {"launch.run"},
        {
            "launch.local",
            "launch.submit",
            "launch.evaluate",
            "launch.simulate",
            "launch.scale",
            "launch.plan_allocation",
        },
    ],
    # the backend-independent core never reaches into one backend; only the seam (backends.py)
    # names them, and the two multi-rank backends never import each other
    "areal_jobs.trainer": [
        {"areal_jobs.trainer"},
        {"areal_jobs.trainer.megatron", "areal_jobs.trainer.fsdp"},
        {"areal_jobs.trainer.backends"},
        {"areal_jobs.trainer.main"},
    ],
}


def room_of(module: str, unit: str) -> str:
    """The room of `module` inside `unit`: its first sub-package or top-level module."""
    rest = module.removeprefix(unit).lstrip(".").split(".")
    name = f"{unit}.{rest[0]}" if rest[0] else unit
    rooms = {r for level in ROOMS[unit] for r in level}
    return name if name in rooms else unit


def test_rooms_import_downward_only():
    wrong = []
    for module, path in all_modules().items():
        unit = next((u for u in ROOMS if module == u or module.startswith(u + ".")), None)
        if unit is None:
            continue
        level = {room: i for i, rooms in enumerate(ROOMS[unit]) for room in rooms}
        source = room_of(module, unit)
        for line, target in imports_of(path):
            if not (target == unit or target.startswith(unit + ".")):
                continue
            dest = room_of(target, unit)
            if dest == source or level[dest] < level[source]:
                continue
            wrong.append(f"{path.relative_to(REPO)}:{line} imports {target} ({source} -> {dest})")
    assert wrong == [], "\n".join(wrong)


def test_the_checker_sees_lazy_relative_and_type_only_imports(tmp_path, monkeypatch):
    """The parser itself: an import hidden in a function or a TYPE_CHECKING block still counts."""
    package = tmp_path / "areal_jobs" / "weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sender.py").write_text("")
    (tmp_path / "areal_jobs" / "trainer").mkdir()
    (tmp_path / "areal_jobs" / "trainer" / "__init__.py").write_text("")
    source = package / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sender\n"
        "if TYPE_CHECKING:\n    from areal_jobs.trainer import inbox\n"
        "def later():\n    import launch.planning.plan\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert imports_of(source) == [
        (2, "areal_jobs.weights.sender"),
        (4, "areal_jobs.trainer"),
        (6, "launch.planning.plan"),
    ]


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components
