"""The packages' shape, read from the source with ``ast`` (nothing is imported):

* no import cycle between the repository's modules;
* the layers codec ← engine ← hydra_rpc ← tools: a package imports only its own layer and
  those below (codec: the wire format, sans-IO; engine: the model and its actor; hydra_rpc: the
  servers in front of it; tools: fuzzer, inspector, bench);
* the wire rooms reach the engine's inside only through its facade, ``engine.api``;
* no module over ``MAX_LINES`` lines, generated tables aside.

Every import counts, wherever it is: at the top, in a function, under ``TYPE_CHECKING``. A
function-level import still ties the two modules together (it only defers the failure), and a
type-only cycle is the same knot for a reader. Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` too; those implicit edges are not counted, or every package that re-exports
from its own submodules would be a cycle.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("codec", "engine", "hydra_rpc", "tools")  # each may import only itself and those before it
MAX_LINES = 450

#: Modules a lower layer loads by name (a string, not an import) from a higher one, with why.
#: hydra_rpc's CLI is the one program entry: its COMMANDS table names the tools' commands so
#: that ``hydra-rpc fuzz`` and friends work without hydra_rpc importing the tools.
LOADED_BY_NAME = {
    "hydra_rpc.cli": "COMMANDS: `hydra-rpc inspect | fuzz | bench` load their tools module with importlib",
}

#: The engine's stateful inside: the wire rooms (hydra_rpc) reach it only through ``engine.api``.
#: The values the facade takes and returns (engine.jobs, engine.status, engine.sampling, …) and
#: stateless helpers (chat parsing, the parameter table) are not listed: they hold no engine state.
ENGINE_INSIDE = ("engine.actor", "engine.scheduler", "engine.stepper", "engine.messages", "engine.slot_state_ops",
                 "engine.reloader", "engine.prompt_cache", "engine.host_cache", "engine.checkpoints", "engine.erase",
                 "engine.compute_threads", "engine.llama_backend.model", "engine.llama_backend.runtime",
                 "engine.llama_backend.batch", "engine.llama_backend.factory", "engine.llama_backend.build",
                 "engine.llama_backend.context", "engine.llama_backend.seq_state")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(f): f for layer in LAYERS for f in sorted((ROOT / layer).rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The repository module ``name`` imports (``a.b.C`` → ``a.b``), or None for a foreign one."""
    mods = modules()
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    # ``from pkg import name``: the submodule pkg.name when there is one, else pkg itself
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names]


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """module → {repository module it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules().items():
        out = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, path, node):
                    target = _resolve(name)
                    if target is not None and target != module:
                        out.setdefault(target, node.lineno)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """One cycle through the component's first module, each edge with the importing line."""
    inside, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    hops = paths[v] + [start]
                    return " -> ".join(f"{a} ({modules()[a].relative_to(ROOT)}:{graph[a][b]})"
                                       for a, b in zip(hops, hops[1:])) + f" -> {start}"
                if w in inside and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component has one


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


# ---- the checks -----------------------------------------------------------------------------------

def test_the_graph_sees_the_packages():
    graph = import_graph()
    assert {"codec.errors", "engine.backend", "hydra_rpc.app", "tools.fuzzer.cli"} <= graph.keys()
    assert "engine.backend" in graph["engine.llama_backend.factory"]  # a relative import, resolved
    assert "engine.llama_backend.factory" in graph["engine.config"]  # one inside a function


def test_no_import_cycles():
    graph = import_graph()
    cycles = [f"{_cycle_in(c, graph)}\n  (the knot: {', '.join(c)})" for c in _components(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_layers_import_only_downwards():
    wrong = [f"{modules()[a].relative_to(ROOT)}:{line} imports {b}"
             for a, targets in import_graph().items() for b, line in targets.items() if _layer(b) > _layer(a)]
    assert not wrong, "imports against codec <- engine <- hydra_rpc <- tools:\n" + "\n".join(wrong)


def test_modules_of_a_higher_layer_are_loaded_by_name_only_where_documented():
    names = {m for m in modules() if "." in m}  # a bare "tools" is a word (a chat's tools), not a load
    loaders: dict[str, list[str]] = {}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                    and _layer(node.value) > _layer(module)):
                loaders.setdefault(module, []).append(node.value)
    assert loaders.keys() <= LOADED_BY_NAME.keys(), {m: loaders[m] for m in loaders.keys() - LOADED_BY_NAME.keys()}
    assert loaders.get("hydra_rpc.cli"), "the documented CLI entry no longer loads the tools: drop its exception"


def _generated(path: Path) -> bool:
    """A table written by a script: its docstring says GENERATED (scripts/gen_llama_args.py's does;
    tests/test_code_shape.py skips the same modules)."""
    return "GENERATED" in (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")


def _oversized(paths: list[Path]) -> list[str]:
    counts = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in paths if not _generated(p)}
    return [f"{p.relative_to(ROOT)}: {n} lines" for p, n in sorted(counts.items()) if n > MAX_LINES]


def test_modules_are_at_most_450_lines():
    paths = list(modules().values())
    assert _generated(ROOT / "hydra_rpc/cli/llama_args_data.py")  # the one generated table, exempt
    too_long = _oversized(paths)
    assert not too_long, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(too_long)


def test_the_wire_reaches_the_engine_only_through_its_facade():
    graph = import_graph()
    assert "engine.api" in graph["hydra_rpc.app"]
    wrong = [f"{modules()[a].relative_to(ROOT)}:{line} imports {b}"
             for a, targets in graph.items() if a.startswith("hydra_rpc")
             for b, line in targets.items() if b in ENGINE_INSIDE]
    assert not wrong, "the wire holds engine.api.EngineApi, never the engine's inside:\n" + "\n".join(wrong)
    for module, path in modules().items():  # the run itself (GenJob) never leaves the engine
        if module.startswith("hydra_rpc"):
            assert "GenJob" not in path.read_text(encoding="utf-8"), f"{path.relative_to(ROOT)} names GenJob"
