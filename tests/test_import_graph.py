"""The import graph of jaxserve/: no loop, and no module importing a layer above its own.

The layers are docs/architecture.md's ("Layers"), by top-level package folder of jaxserve/ so
that regrouping modules inside a folder keeps their layer: plain data (core, config,
structured), then the model and its LoRA adapters, then the runner, then speculative decoding,
then the engine, then the front ends, the benchmarks and the package root. A top-level folder
no layer names fails the test. The compiled step takes exactly (state, kv, inputs).

Every import statement is an edge, wherever it sits: at module level, inside a function (a lazy
import, to keep start-up light, still runs the module it names, so it may not climb either),
and under `if TYPE_CHECKING:` (a type checker follows it). Relative imports are resolved.
`from pkg import name` is an edge to pkg.name when that is a module, else to pkg. Generated
protobuf code (jaxserve/entrypoints/grpc/pb/) is left out.

The package root jaxserve/__init__.py is a facade. Python runs it before any submodule of the
package; that implicit edge is not drawn (it would close a loop through each of the root's eager
imports). Its own imports, eager and the lazy re-exports in its `__getattr__` (LLM,
RequestOutput) alike, are edges like any other module's and take part in loop detection, so a
module inside the package that imports `jaxserve` (for `__version__`) must not be reachable from
entrypoints.llm or engine.outputs.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXCLUDED = ("jaxserve.entrypoints.grpc.pb",)
# Lowest first, by top-level folder of jaxserve/ ("": the package root, jaxserve/__init__.py).
LAYERS = (
    ("core", "config", "structured"),   # plain data: the scheduler side, settings, grammars
    ("model", "lora"),                  # the model, and its LoRA adapters
    ("runner",),                        # the device side: compiled steps, KV cache, sampler
    ("spec",),                          # speculative decoding, on the runner's pieces
    ("engine",),                        # the loop, its thread, intake: no front end
    ("entrypoints", "bench", ""),       # front ends, benchmarks, the package root
)
MAX_LOOPS_LISTED = 100


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of jaxserve/ but the excluded ones."""
    files = {}
    for path in sorted((ROOT / "jaxserve").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if not any(_within(name, e) for e in EXCLUDED):
            files[name] = path
    return files


def _imports(name: str, path: Path, files: dict[str, Path]):
    """(imported module, line) for every import statement anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = package.split(".")
                assert node.level <= len(parts), f"{path}:{node.lineno}: import above jaxserve/"
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{module}" if module else base
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield (full if full in files else module), node.lineno


def module_graph() -> dict[str, dict[str, int]]:
    """module -> {jaxserve module it imports: line of the first such import}."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        deps: dict[str, int] = {}
        for dep, line in _imports(name, path, files):
            if dep in files and dep != name:
                deps[dep] = min(line, deps.get(dep, line))
        graph[name] = deps
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (a module never imports itself here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def import_loops(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every elementary cycle (up to MAX_LOOPS_LISTED), each starting at its smallest module."""
    loops = []
    for component in strongly_connected(graph):
        members = set(component)
        for start in component:  # cycles through `start` and modules after it only: each once
            def walk(path: list[str]) -> None:
                for dep in sorted(graph[path[-1]]):
                    if len(loops) >= MAX_LOOPS_LISTED:
                        return
                    if dep == start:
                        loops.append(path + [start])
                    elif dep in members and dep > start and dep not in path:
                        walk(path + [dep])
            walk([start])
    return loops


def describe(loop: list[str], graph: dict[str, dict[str, int]], files: dict[str, Path]) -> str:
    steps = [f"{a} ({files[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(loop, loop[1:])]
    return " -> ".join(steps + [loop[-1]])


def folder(module: str) -> str:
    """The module's top-level package folder under jaxserve/ ("" for the root itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    """The index in LAYERS of the module's top-level folder; KeyError when none names it."""
    return {name: i for i, names in enumerate(LAYERS) for name in names}[folder(module)]


def climbing(graph: dict[str, dict[str, int]]) -> list[tuple[str, int, str]]:
    """(module, line, module it imports) for every import of a layer above the importer's."""
    return [(m, line, d) for m, deps in graph.items() for d, line in deps.items()
            if layer(d) > layer(m)]


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "jaxserve" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from ..sub import c\n    import jaxserve.sub.a\n")
    (pkg / "c.py").write_text("")
    files = {"jaxserve.sub": pkg / "__init__.py", "jaxserve.sub.a": pkg / "a.py",
             "jaxserve.sub.b": pkg / "b.py", "jaxserve.sub.c": pkg / "c.py"}
    edges = {n: {d for d, _ in _imports(n, p, files)} for n, p in files.items()}
    assert edges["jaxserve.sub"] == {"jaxserve.sub.a"}
    assert "jaxserve.sub.b" in edges["jaxserve.sub.a"]
    assert {"jaxserve.sub.c", "jaxserve.sub.a"} <= edges["jaxserve.sub.b"]
    graph = {n: {d: 1 for d in deps if d in files and d != n} for n, deps in edges.items()}
    assert import_loops(graph) == [["jaxserve.sub.a", "jaxserve.sub.b", "jaxserve.sub.a"]]


def test_no_import_loop():
    graph, files = module_graph(), module_files()
    loops = import_loops(graph)
    listed = "\n  ".join(describe(loop, graph, files) for loop in loops)
    assert not loops, (f"{len(loops)} import loop(s), each module followed by the file:line of "
                       f"its import of the next:\n  {listed}")


def test_every_top_level_folder_has_a_layer_and_every_layer_a_folder():
    folders = {folder(m) for m in module_files()}
    named = {name for names in LAYERS for name in names}
    assert not folders - named, f"folders no layer names: {sorted(folders - named)}"
    assert not named - folders, f"layers name folders that do not exist: {sorted(named - folders)}"


def test_a_lazy_import_that_climbs_is_caught(tmp_path):
    core, engine = tmp_path / "jaxserve" / "core", tmp_path / "jaxserve" / "engine"
    core.mkdir(parents=True)
    engine.mkdir()
    (core / "a.py").write_text("def f():\n    from jaxserve.engine import b\n    return b\n")
    (engine / "b.py").write_text("from jaxserve.core import a\n")
    files = {"jaxserve.core.a": core / "a.py", "jaxserve.engine.b": engine / "b.py"}
    graph = {n: {d: line for d, line in _imports(n, p, files) if d in files}
             for n, p in files.items()}
    assert climbing(graph) == [("jaxserve.core.a", 2, "jaxserve.engine.b")], graph


def test_no_module_imports_a_layer_above_its_own():
    graph, files = module_graph(), module_files()
    bad = [f"{m} ({folder(m)}, layer {layer(m)}, {files[m].relative_to(ROOT)}:{line}) -> {d} "
           f"({folder(d)}, layer {layer(d)})" for m, line, d in climbing(graph)]
    assert not bad, "imports from above:\n  " + "\n  ".join(bad)


def test_the_compiled_steps_take_state_kv_inputs():
    from jaxserve.runner.model_runner import plain_step
    from jaxserve.spec import step

    for fn, bound in ((plain_step, 3), (step.ngram_step, 3), (step.draft_model_step, 6),
                      (step.draft_sync_step, 2)):
        params = list(inspect.signature(fn).parameters)[bound:]
        assert params == ["state", "kv", "inputs"], f"{fn.__name__} takes {params}"
