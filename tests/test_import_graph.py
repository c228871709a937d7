"""The module-level import graph of jaxserve/: no loop, and no module importing a layer above
its own (DESIGN.md's layering: plain data, then model and kernels, then runner, then spec, then
engine, front ends and benchmarks). Function-local imports (lazy, to keep start-up light) are
not edges. The compiled step takes exactly (state, kv, inputs).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# plain data: the scheduler side, settings, grammars, and what the engine hands back
DATA = ("jaxserve.core", "jaxserve.config", "jaxserve.structured", "jaxserve.engine.info",
        "jaxserve.engine.outputs", "jaxserve.engine.detokenizer", "jaxserve.model.byte_level",
        "jaxserve.model.step_inputs", "jaxserve.model.step_layout")


def module_graph() -> dict[str, set[str]]:
    files = {}
    for path in (ROOT / "jaxserve").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in files else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def layer(module: str) -> int:
    if any(module == d or module.startswith(d + ".") for d in DATA):
        return 0
    if module.startswith("jaxserve.model"):
        return 1
    if module.startswith("jaxserve.runner"):
        return 2
    if module.startswith("jaxserve.spec"):
        return 3
    return 4  # engine, front ends, benchmarks, cli


def test_no_import_loop():
    graph, done, loops = module_graph(), set(), []

    def visit(node, path):
        for dep in graph[node]:
            if dep in path:
                loops.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                done.add(dep)
                visit(dep, path + [dep])

    for node in graph:
        if node not in done:
            done.add(node)
            visit(node, [node])
    assert not loops, f"import loops: {loops}"


def test_no_module_imports_a_layer_above_its_own():
    graph = module_graph()
    bad = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
           if layer(m) < 4 and layer(d) > layer(m)]
    assert not bad, f"imports from above: {bad}"


def test_the_compiled_steps_take_state_kv_inputs():
    from jaxserve.runner.model_runner import plain_step
    from jaxserve.spec import step

    for fn, bound in ((plain_step, 2), (step.ngram_step, 3), (step.draft_model_step, 6),
                      (step.draft_sync_step, 2)):
        params = list(inspect.signature(fn).parameters)[bound:]
        assert params == ["state", "kv", "inputs"], f"{fn.__name__} takes {params}"
