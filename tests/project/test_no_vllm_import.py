"""No module of omni_cache imports vLLM at module scope (spec/contract.md, "No module imports vLLM at module scope").

Scans every module's AST: an ``import vllm...`` / ``from vllm... import`` is
allowed only inside a function body. Also checks that ``import omni_cache``
(and the integration package) works in a fresh interpreter where any ``vllm``
import would fail, and that the scanner itself flags a module-level import. And no two modules
import each other, directly or around a longer circle (a package's ``__init__`` only names its
submodules' exports lazily, so its edges are left out).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import omni_cache

PACKAGE_DIR = Path(omni_cache.__file__).resolve().parent


def _is_vllm(name: str | None) -> bool:
    return name is not None and (name == "vllm" or name.startswith("vllm."))


def module_level_vllm_imports(source: str) -> list[int]:
    """Line numbers of vLLM imports outside any function body (class bodies,
    ``if``/``try`` blocks and ``TYPE_CHECKING`` guards all run at import)."""
    lines: list[int] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            plain = isinstance(child, ast.Import) and any(_is_vllm(a.name) for a in child.names)
            from_ = isinstance(child, ast.ImportFrom) and child.level == 0 and _is_vllm(child.module)
            if plain or from_:
                lines.append(child.lineno)
            visit(child)

    visit(ast.parse(source))
    return lines


def test_the_scanner_flags_module_level_imports_only() -> None:
    src = (
        "import os\nimport vllm.config\nfrom vllm import LLM\n"
        "class A:\n    from vllm.v1 import x\n"
        "try:\n    import vllm\nexcept ImportError:\n    pass\n"
        "def f():\n    import vllm\n    from vllm.distributed import get_pp_group\n"
        "import vllmish\n"
    )
    assert module_level_vllm_imports(src) == [2, 3, 5, 7]


def test_no_module_imports_vllm_at_module_scope() -> None:
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert any(p.parent.name == "integration" for p in modules), "integration package not scanned"
    offenders = {
        str(p.relative_to(PACKAGE_DIR.parent)): lines
        for p in modules
        if (lines := module_level_vllm_imports(p.read_text(encoding="utf-8")))
    }
    assert offenders == {}, f"module-level vLLM imports: {offenders}"


def test_import_works_with_vllm_absent() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import omni_cache, omni_cache.integration, omni_cache.integration.runner_hooks as rh\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
        "assert rh.vllm_is_last_pp_rank() is True\n"
        "print(omni_cache.PrefixCacheSchedulerAdapter.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PrefixCacheSchedulerAdapter"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the omni_cache modules it imports anywhere (module scope or inside functions)."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = ("omni_cache", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("omni_cache"):
                deps.add(node.module)  # type: ignore[arg-type]
                deps |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name and modules[d].name != "__init__.py"}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_two_modules_import_each_other() -> None:
    graph = _import_graph()
    assert "omni_cache.verify.trace_tlc" in graph["omni_cache.verify.tenancy_trace"]  # the scan sees imports
    assert not _circles(graph), "import circles: " + "; ".join(" -> ".join(c) for c in _circles(graph))
    assert _circles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # and it would see one
