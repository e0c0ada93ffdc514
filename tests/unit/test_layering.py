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

# Lowest first. A unit (a subpackage of areal_jobs, a top-level module of areal_jobs, a whole
# top-level package, or one of NESTED_UNITS) may import units of lower layers only, never one of
# its own layer or above.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundations",
        {
            "areal_jobs",  # the package docstring, and installing `moved`
            "areal_jobs.config",
            "areal_jobs.api",
            "areal_jobs.logs",
            "areal_jobs.metrics",
            "areal_jobs.report",
            "areal_jobs.checkpoint",
            "areal_jobs.samples",
            "areal_jobs.atomic",
            "areal_jobs.staleness",  # the eta rule both roles apply (admission; the trainer's is_fresh)
            "areal_jobs.staleness_bound",  # algo.max_staleness=auto: how eta follows the measured drift
            "areal_jobs.moved",  # former module names, for one release
        },
    ),
    ("transport", {"areal_jobs.transport"}),
    # the built-in tasks: prompts, worked answers, what a verifier checks; data and reward read them
    ("tasks", {"areal_jobs.tasks"}),
    ("components", {"areal_jobs.data", "areal_jobs.reward", "areal_jobs.weights"}),
    # episodes: workflows, tools and the OpenAI-compatible endpoint, run inside the controller
    ("agent", {"areal_jobs.agent"}),
    ("roles", {"areal_jobs.rollout", "areal_jobs.trainer"}),
    # the builders of the committed models: they train (the trainer's packing, the task's verifier)
    ("warm starts", {"areal_jobs.tasks.warm_start"}),
    ("launch", {"launch"}),
    ("bench", {"bench"}),
]
# Sub-packages that sit on another floor than their parent package: a unit of their own.
NESTED_UNITS = ("areal_jobs.tasks.warm_start",)
# Imports inside one layer that are part of the design, each with its reason.
SIDEWAYS = {
    ("areal_jobs.report", "areal_jobs.metrics"): "the end-of-run summary reads the metrics sink's rows",
    (
        "areal_jobs.checkpoint",
        "areal_jobs.atomic",
    ): "a checkpoint's meta.json and `latest` are replaced atomically",
    ("areal_jobs", "areal_jobs.moved"): "importing the package installs the finder of former names",
    (
        "areal_jobs.staleness_bound",
        "areal_jobs.config",
    ): "eta's law (algo.max_staleness=auto) reads its knobs from algo's config",
    (
        "areal_jobs.data",
        "areal_jobs.reward",
    ): "a mixture's sources name their verifiers, checked against reward's registry",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def unit_of(module: str) -> str:
    for nested in NESTED_UNITS:
        if module == nested or module.startswith(nested + "."):
            return nested
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
# (and the unit's top-level modules listed as shared), never one beside or above it. A module in a
# room not listed belongs to the unit's own room. Units nest: launch.planning's rooms are checked
# inside launch.planning, and launch.planning as one room of launch.
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
    # the simulator imports no planner; what fits (fit/), where things go (layout/) and when to
    # re-plan (replanning/) ask each other, so they share a floor; the reports read all of them
    "launch.planning": [
        {"launch.planning.sim"},
        {"launch.planning"},
        {"launch.planning.reports"},
    ],
    # the step's stages, each reading only those below it: the loss knows no batch layout, the
    # batch no model; the backend-independent core (loop, session at the top) never reaches into
    # one backend; only the seam (backends.py) names them, and the backends never import each other
    "areal_jobs.trainer": [
        {"areal_jobs.trainer.objective"},
        {"areal_jobs.trainer.intake"},
        {"areal_jobs.trainer.forward", "areal_jobs.trainer.dist"},
        {"areal_jobs.trainer.publish"},
        {"areal_jobs.trainer"},
        {"areal_jobs.trainer.torch", "areal_jobs.trainer.megatron", "areal_jobs.trainer.fsdp"},
        {"areal_jobs.trainer.backends"},
        {"areal_jobs.trainer.main"},
    ],
    # the shared harness, the rooms by subject (never each other), then the runner and its tables
    # (report.py formats a room's section with that room's own table)
    "bench": [
        {"bench", "bench.harness"},
        {
            "bench.staleness",
            "bench.trainer",
            "bench.weights",
            "bench.rollout",
            "bench.reward",
            "bench.e2e",
        },
        {"bench.report"},
        {"bench.__main__"},
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
        for unit in [u for u in ROOMS if module == u or module.startswith(u + ".")]:
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


def test_every_room_exists():
    """A room renamed or removed must leave ROOMS too, or its rule silently guards nothing."""
    modules = all_modules()
    missing = sorted(r for rooms in ROOMS.values() for level in rooms for r in level if r not in modules)
    assert missing == [], f"rooms in ROOMS with no module or package: {missing}"


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
