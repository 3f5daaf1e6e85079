"""Protects the layering of the package: no import runs up a layer, and names come from their definer.

The wings, bottom to top, and what each may import of the package (every ``import`` and ``from ...
import`` counts: module scope, function bodies and ``TYPE_CHECKING`` blocks alike):

* ``omni_cache.runtime`` (the cache itself): only the runtime. It never imports vLLM, not even
  lazily inside a function (``tests/project/test_no_vllm_import.py`` checks the rest of the package
  imports vLLM only inside functions, and that no two modules import each other).
* ``omni_cache.integration`` (everything that meets vLLM): the runtime and itself.
* the facade -- ``omni_cache`` itself and the seed's paths ``omni_cache.adapter``,
  ``omni_cache.manager``, ``omni_cache.interface`` -- names the runtime's and the integration's
  public objects: it imports those two wings only.
* ``omni_cache.verify`` (TLC, trace validation, spec rendering) checks the runtime against its
  models: it imports the runtime and itself. It sits beside the harness, not under or over it:
  neither imports the other; only the command line (and the tests) import it.
* ``omni_cache.harness`` (simulated and real engines, the pipeline, the bench): the runtime, the
  integration, the facade and itself -- never the command line.
* ``omni_cache.cli`` (the ``omni-cache`` command): anything.

And a name the runtime or the integration defines is imported from the module that defines it
(a value type from ``runtime.events``, an error from ``runtime.errors``), never through a module
that only re-exports it (``integration.adapter``, the seed's paths, ``runtime.interface``'s
errors, a package ``__init__``). The ``omni_cache`` package itself is the public API: the command
line's ``selfcheck`` imports from it on purpose, as a user would.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import omni_cache

PACKAGE_DIR = Path(omni_cache.__file__).resolve().parent
FACADE = ("omni_cache", "omni_cache.adapter", "omni_cache.manager", "omni_cache.interface")
MAY_IMPORT = {
    "runtime": {"runtime"},
    "integration": {"runtime", "integration"},
    "facade": {"runtime", "integration"},
    "verify": {"runtime", "verify"},
    "harness": {"runtime", "integration", "facade", "harness"},
    "cli": {"runtime", "integration", "facade", "verify", "harness", "cli"},
}
DEFINED_BELOW = ("runtime", "integration")  # their names are imported from their definer


def wing(module: str) -> str:
    if module in FACADE:
        return "facade"
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in MAY_IMPORT:
        raise AssertionError(f"{module} is in no wing: give it one in this test")
    return parts[1]


def package_sources() -> dict[str, str]:
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("omni_cache", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text(encoding="utf-8")
    return out


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


class ImportGraph:
    """Every import of the package's modules (``{module: source}``), resolved to package modules."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.modules = set(sources)
        self.trees = {m: ast.parse(s) for m, s in sources.items()}
        self.defined = {m: _top_level_names(t) for m, t in self.trees.items()}
        # (importer, line, imported module, imported name or None)
        self.imports: list[tuple[str, int, str, str | None]] = []
        for module, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    self.imports += [(module, node.lineno, a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    base = node.module
                    if node.level:
                        package = module if f"{module}.__init__" in sources or any(
                            m.startswith(module + ".") for m in self.modules) else module.rpartition(".")[0]
                        base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base])
                    for a in node.names:
                        full = f"{base}.{a.name}"
                        self.imports.append((module, node.lineno, full, None) if full in self.modules
                                            else (module, node.lineno, base, a.name))

    def upward(self) -> list[str]:
        """Imports of a wing its importer may not import."""
        out = []
        for importer, line, target, _ in self.imports:
            if target.split(".")[0] != "omni_cache":
                continue
            if wing(target) not in MAY_IMPORT[wing(importer)]:
                out.append(f"{importer}:{line} ({wing(importer)}) imports {target} ({wing(target)})")
        return sorted(set(out))

    def runtime_vllm(self) -> list[str]:
        return sorted(f"{importer}:{line} imports {target}" for importer, line, target, _ in self.imports
                      if wing(importer) == "runtime" and target.split(".")[0] == "vllm")

    def definer(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> str | None:
        """The package module that defines ``name`` as imported from ``module`` (None: not found)."""
        if module not in self.modules or module in seen:
            return None
        if name in self.defined[module]:
            return module
        for importer, _, target, imported in self.imports:
            if importer == module and imported == name:
                return self.definer(target, name, seen | {module})
        return None

    def re_exported(self) -> list[str]:
        """Names of the runtime or the integration imported through a module that does not define them."""
        out = []
        for importer, line, target, name in self.imports:
            if name is None or target == "omni_cache" or target not in self.modules:
                continue
            where = self.definer(target, name)
            if where is not None and where != target and wing(where) in DEFINED_BELOW:
                out.append(f"{importer}:{line} imports {name} from {target}, defined in {where}")
        return sorted(set(out))


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(package_sources())


def test_no_import_runs_up_a_layer(graph: ImportGraph) -> None:
    assert graph.upward() == []
    assert any(t.startswith("omni_cache.runtime") for i, _, t, _ in graph.imports if i.startswith("omni_cache.cli"))


def test_the_runtime_never_imports_vllm(graph: ImportGraph) -> None:
    assert graph.runtime_vllm() == []


def test_runtime_and_integration_names_come_from_their_definer(graph: ImportGraph) -> None:
    assert graph.re_exported() == []


def test_every_module_sits_in_a_wing(graph: ImportGraph) -> None:
    assert {wing(m) for m in graph.modules} == set(MAY_IMPORT)


_SAMPLE = {
    "omni_cache": "",
    "omni_cache.runtime": "",
    "omni_cache.runtime.events": "class Event: ...\n",
    "omni_cache.runtime.manager": "from omni_cache.runtime.events import Event\n"
                                  "def f():\n    from omni_cache.integration.adapter import Adapter\n"
                                  "    import vllm.config\n",
    "omni_cache.integration": "",
    "omni_cache.integration.adapter": "from omni_cache.runtime.events import Event\nclass Adapter: ...\n",
    "omni_cache.harness": "",
    "omni_cache.harness.run": "from omni_cache.integration.adapter import Event\nfrom omni_cache.cli import main\n"
                              "from omni_cache.verify import check\n",
    "omni_cache.verify": "def check(): ...\n",
    "omni_cache.cli": "def main(): ...\nfrom omni_cache.harness import run\n",
}


def test_the_checks_see_an_upward_import_a_vllm_import_and_a_re_export() -> None:
    sample = ImportGraph(_SAMPLE)
    assert sample.upward() == [
        "omni_cache.harness.run:2 (harness) imports omni_cache.cli (cli)",
        "omni_cache.harness.run:3 (harness) imports omni_cache.verify (verify)",
        "omni_cache.runtime.manager:3 (runtime) imports omni_cache.integration.adapter (integration)",
    ]
    assert sample.runtime_vllm() == ["omni_cache.runtime.manager:4 imports vllm.config"]
    assert sample.re_exported() == [
        "omni_cache.harness.run:1 imports Event from omni_cache.integration.adapter, defined in omni_cache.runtime.events",
    ]
