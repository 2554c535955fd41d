"""The import graph of ppmedia: no cycle among its modules, and the layers import only downward.

The graph is read from the source with ``ast`` (no module is imported): every ``import`` and
``from ... import`` at module level and inside functions (where a cycle usually hides), the names a
package imports lazily (its ``_EXPORTS`` map, :mod:`ppmedia._lazy`), but not ``if TYPE_CHECKING:``
blocks (never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``; a module's own parent packages are not edges (Python imports them first anyway).
"""

from __future__ import annotations

import ast
import functools
import pathlib
from typing import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: package -> its source folder (pyproject's package-dir)
SOURCES = {"ppmedia": ROOT / "core", "ppmedia.registry": ROOT / "registry", "ppmedia.adapters": ROOT / "adapters"}

#: the layers, bottom first: a module imports only modules of its own layer or a lower one (or a leaf).
#: The package reads as docs/architecture.md draws it: the contract, the producer side (splitting media,
#: layouts, the registry and the family adapters it looks up), the pipeline runtime, the data path and the
#: planner built on it, the testing kit, the training command, the command line, the package's lazy names.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contract", ("ppmedia.chunk",)),
    ("producer", ("ppmedia.producer", "ppmedia.layouts", "ppmedia.balance", "ppmedia.registry", "ppmedia.adapters")),
    ("pipeline", ("ppmedia.pipeline",)),
    ("data", ("ppmedia.data", "ppmedia.packing", "ppmedia.planning")),
    ("testing", ("ppmedia.testing",)),
    ("train", ("ppmedia.train",)),
    ("cli", ("ppmedia.cli", "ppmedia.__main__")),
    ("package", ("ppmedia",)),
)
#: the pipeline runtime: never imports the planner, the kit or the demo (they use it)
PIPELINE = ("ppmedia.pipeline",)
#: the step-time planner and its command (the ``ppmedia plan`` models), the testing kit, the demo
ABOVE_PIPELINE = ("ppmedia.cli.plan", "ppmedia.planning.stepmodel", "ppmedia.planning.simulate",
                  "ppmedia.planning.replay", "ppmedia.planning.loads", "ppmedia.testing", "ppmedia.cli.demo")
#: leaves every layer may use and that import no ppmedia module: timelines and their SVG (the planner's
#: predicted ones and the pipeline's measured ones, :class:`ppmedia.pipeline.StepTracer`), the encoder
#: cost model (adapters, the balancer, the planner), packed rows' per-sample positions and isolation rules
#: (the adapters, the stages, the packing), text tables (the command line, the parity report), the lazy
#: attributes of the packages
LEAVES = ("ppmedia.planning.timeline", "ppmedia.planning.costs", "ppmedia.packing.positions",
          "ppmedia.packing.isolation", "ppmedia.cli.tables", "ppmedia._lazy")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if name.startswith(tuple(f"{p}." for p in SOURCES if p != package and p.startswith(package + "."))):
                continue  # a folder of another package
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported ppmedia module: the line of the first such import} (built once; not to be modified)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
                if isinstance(node.value, ast.Dict):  # lazy attributes: name -> submodule of this package
                    targets = [f"{package}.{v.value}" for v in node.value.values if isinstance(v, ast.Constant)]
            for target in targets:
                found = owner(target)
                if found is not None and found != module and not module.startswith(found + "."):
                    edges.setdefault(found, getattr(node, "lineno", 0))
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the graph is a few hundred modules: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _loop(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One closed path through ``component``, with the file line of each import."""
    members, start = set(component), component[0]
    path, seen = [start], {start}
    while True:  # walk inside the component until a module repeats
        here = path[-1]
        step = next(w for w in sorted(graph[here]) if w in members)
        if step in seen:
            path = path[path.index(step):] + [step]
            break
        path.append(step)
        seen.add(step)
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def _in(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in layer)


def test_the_graph_sees_function_level_and_lazy_imports():
    graph = import_graph()
    assert "ppmedia.pipeline.stages" in graph and "ppmedia.testing.parity" in graph and "ppmedia.adapters.base" in graph
    assert "ppmedia.pipeline" in graph["ppmedia.testing.parity.steps"]  # its imports are all inside functions
    assert "ppmedia.producer.split" in graph["ppmedia"]  # through _EXPORTS only
    assert "ppmedia.testing.kit" in graph["ppmedia.testing"]  # the same
    planted = {**graph, "ppmedia.pipeline.stages": {**graph["ppmedia.pipeline.stages"], "ppmedia.planning.stepmodel": 1}}
    assert any("ppmedia.planning.stepmodel" in c and "ppmedia.pipeline.stages" in c for c in cycles(planted))


def test_no_import_cycle_among_ppmedia_modules():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among ppmedia modules:\n" + "\n".join(
        f"  {len(c)} modules, e.g. {_loop(graph, c)}; every import among them:\n    "
        + "\n    ".join(f"{a} line {graph[a][b]} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in found)


def test_the_pipeline_never_imports_the_planner_the_kit_or_the_demo():
    graph = import_graph()
    upward = []
    for module in sorted(m for m in graph if _in(m, PIPELINE)):
        via: dict[str, str] = {module: module}  # everything it imports, directly or not: the path there
        todo = [module]
        while todo:
            here = todo.pop()
            for target, line in sorted(graph[here].items()):
                if target not in via:
                    via[target] = f"{via[here]} (line {line}) -> {target}"
                    if _in(target, ABOVE_PIPELINE):
                        upward.append(via[target])  # the first step up; what it imports is not listed
                    else:
                        todo.append(target)
    assert not upward, "the pipeline imports what is built on it:\n  " + "\n  ".join(upward)


def test_the_shared_leaves_import_no_ppmedia_module():
    graph = import_graph()
    for leaf in LEAVES:
        assert graph[leaf] == {}, f"{leaf} imports {graph[leaf]} (module: line)"


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (the longest matching prefix wins)."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if _in(module, (p,))), default=None)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[1]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import that runs back up the layers (a leaf may be imported from anywhere)."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            if target not in LEAVES and layer_of(target) > layer_of(module):
                found.append(f"{module} (layer {LAYERS[layer_of(module)][0]}) line {line} imports {target} "
                             f"(layer {LAYERS[layer_of(target)][0]})")
    return found


def test_the_layers_import_only_downward():
    graph = import_graph()
    assert not upward_imports(graph), "imports running back up the layers:\n  " + "\n  ".join(upward_imports(graph))
    # every module sits in a layer, and each layer holds modules
    held = {layer_of(m) for m in graph}
    assert held == set(range(len(LAYERS))), held


def test_an_arrow_running_back_up_fails():
    graph = import_graph()
    planted = {**graph, "ppmedia.producer.split": {**graph["ppmedia.producer.split"], "ppmedia.pipeline.stages": 7}}
    assert upward_imports(planted) == [
        "ppmedia.producer.split (layer producer) line 7 imports ppmedia.pipeline.stages (layer pipeline)"]
    planted = {**graph, "ppmedia.data.loader": {**graph["ppmedia.data.loader"], "ppmedia.cli.commands": 3}}
    assert len(upward_imports(planted)) == 1
    leaf = {**graph, "ppmedia.chunk": {**graph["ppmedia.chunk"], "ppmedia.planning.costs": 1}}
    assert upward_imports(leaf) == []  # a leaf imports nothing, so anyone may use it


def test_the_top_of_the_package_reads_as_the_architecture():
    """``core/`` holds the contract, the two public facades and the package's plumbing at its top; every other
    module sits in a concern folder, and each folder is a layer or part of one (docs/architecture.md)."""
    top = sorted(p.name for p in SOURCES["ppmedia"].glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_lazy.py", "balance.py", "chunk.py", "layouts.py"], top
    folders = sorted(p.name for p in SOURCES["ppmedia"].iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == ["cli", "data", "packing", "pipeline", "planning", "producer", "testing", "train"], folders
