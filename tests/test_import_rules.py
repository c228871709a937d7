"""The host-side modules (scheduling, page accounting, plans) never import jax, even indirectly:
importing each in a fresh interpreter loads no jax, and no import reachable from it (lazy ones
included) names jax or a library over it."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_graph import module_files, module_graph

REPO = Path(__file__).resolve().parents[1]


def package_modules(package: str) -> list[str]:
    """The package and every module in it, found on disk, so a new file is covered at once."""
    directory = REPO.joinpath(*package.split("."))
    modules = sorted(f"{package}.{p.stem}" for p in directory.glob("*.py") if p.stem != "__init__")
    assert modules, f"no module in {directory}"
    return [package, *modules]


# jaxserve/core/ and jaxserve/structured/ whole (their docstrings promise no jax), the package
# root (importing jaxserve is cheap), and the host-side modules of the other packages.
HOST_SIDE = [*package_modules("jaxserve.core"), *package_modules("jaxserve.structured"),
             "jaxserve", "jaxserve.config",
             "jaxserve.engine.metrics", "jaxserve.engine.info", "jaxserve.engine.outputs",
             "jaxserve.engine.output_processor", "jaxserve.model.decoder.step_inputs",
             "jaxserve.runner.prepare_inputs", "jaxserve.runner.buckets",
             "jaxserve.runner.protocol", "jaxserve.spec.spec_inputs", "jaxserve.spec.policy",
             "jaxserve.spec.ngram", "jaxserve.lora", "jaxserve.lora.peft", "jaxserve.lora.request",
             "jaxserve.lora.registry"]


@pytest.mark.parametrize("module", HOST_SIDE)
def test_module_does_not_import_jax(module):
    code = (f"import sys; import {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); "
            "assert not heavy, f'imports {heavy[:5]}'")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax:\n{result.stderr[-2000:]}"



JAX_LIBRARIES = ("jax", "jaxlib", "flax", "orbax")  # jax itself, and what jaxserve uses over it


def _jax_imports(path: Path) -> list[int]:
    """Lines of the file's import statements of a JAX_LIBRARIES package, wherever they sit."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        lines += [node.lineno for n in names if n.split(".")[0] in JAX_LIBRARIES]
    return lines


# The package root re-exports LLM lazily (jaxserve/__init__.py's __getattr__), which builds an
# engine and so reaches jax by design; only its eager imports are held to the rule (above).
@pytest.mark.parametrize("module", [m for m in HOST_SIDE if m != "jaxserve"])
def test_no_import_reachable_from_module_is_jax(module):
    """The stricter, static form: following every import (lazy ones inside functions too, as
    test_import_graph.py draws them), no jaxserve module reached imports jax."""
    graph, files = module_graph(), module_files()
    seen, todo = {module}, [module]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    bad = [f"{files[m].relative_to(REPO)}:{line}" for m in sorted(seen)
           for line in _jax_imports(files[m])]
    assert not bad, f"{module} reaches an import of jax at {bad}"
