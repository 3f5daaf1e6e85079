"""Protects ownership: no module of omni_cache reaches into another class's private members.

Each module owns its private state (the docstrings' "Owns:" lines); another module reaches it only
through public names (the manager's ``tier_port``, ``wrap_locks``, a collaborator's methods). The
rule, checked on the AST of every module of the package:

* A *package private* is a name with one leading underscore (dunders are Python's) that a class
  of the package defines: a method, a class-level assignment or field, or an attribute it assigns
  on ``self``/``cls``. A module's top-level ``_name`` is that module's private.
* An *access* is ``x._name`` (read, write or delete) or ``getattr``/``setattr``/``hasattr``/
  ``delattr(x, "_name")`` with the name written out.
* Allowed: ``x`` is ``self``, ``cls`` or ``super()`` (a class and its subclasses); inside a
  class, ``x._name`` when that class defines ``_name`` (``other._inner`` in ``__eq__``); outside
  any class, ``x._name`` when one of the module's own classes defines it (the module's helper
  functions are its own: ``events.layout_rows`` reads ``PrefixCacheWriteLayout._rows``). A class
  never reaches into a sibling class's privates, even in its own module.
* A reach-in: any other access of a package private, and importing another module's private
  name (``from omni_cache.x import _y``) or reading it through the module (``x_module._y``).
* Not ours, so not checked: names no class of the package defines (namedtuple's ``_replace``/
  ``_asdict``/``_fields``, ``sys._getframe``, argparse's ``_subparsers``, vLLM's
  ``_KV_CONNECTOR_AGENT``), and methods of a class built on a third-party base: those override
  the base's own (vLLM's ``_model_forward``, which the omni runner overrides and the pipeline's
  truth tap wraps on vLLM's own runner). What vLLM keeps private is watched by the real-engine
  tests. A name computed at run time (``getattr(x, name)``) is beyond an AST check.
"""

from __future__ import annotations

import ast
import builtins
import sys
from dataclasses import dataclass
from pathlib import Path

import omni_cache

PACKAGE_DIR = Path(omni_cache.__file__).resolve().parent
_STRING_ACCESS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_sources() -> dict[str, str]:
    """Module name -> source, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("omni_cache", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text(encoding="utf-8")
    return out


@dataclass
class _Module:
    name: str
    tree: ast.Module
    imports: dict[str, str]  # local name -> "module" or "module:attr" (module scope and function scope)
    classes: dict[str, ast.ClassDef]  # every class of the module, nested ones too, by name


def _imports(tree: ast.Module, name: str, modules: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    package = name if name in modules and any(m.startswith(name + ".") for m in modules) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                out[a.asname or a.name] = full if full in modules else f"{base}:{a.name}"
    return out


def _stdlib_or_builtin(root: str) -> bool:
    return root in sys.stdlib_module_names or root in ("typing_extensions",)


class PrivateAccessChecker:
    """Finds reach-ins in a set of modules (``{module name: source}``); see the module docstring."""

    def __init__(self, sources: dict[str, str]) -> None:
        names = set(sources)
        self.modules = {n: self._parse(n, s, names) for n, s in sources.items()}
        self._external_memo: dict[tuple[str, str], bool] = {}
        # private name -> modules whose classes define it (package privates)
        self.owners: dict[str, set[str]] = {}
        # module -> its top-level private names
        self.module_privates: dict[str, set[str]] = {}
        for module in self.modules.values():
            self.module_privates[module.name] = self._top_level_privates(module.tree)
            for cls in module.classes.values():
                for member in self._members(cls, methods=not self._external(module, cls.name)):
                    self.owners.setdefault(member, set()).add(module.name)

    @staticmethod
    def _parse(name: str, source: str, names: set[str]) -> _Module:
        tree = ast.parse(source)
        classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        return _Module(name, tree, _imports(tree, name, names), classes)

    @staticmethod
    def _top_level_privates(tree: ast.Module) -> set[str]:
        out = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        return {n for n in out if _private(n)}

    @staticmethod
    def _members(cls: ast.ClassDef, *, methods: bool) -> set[str]:
        out = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and methods:
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
            # a frozen dataclass sets its own: object.__setattr__(self, "_x", v) or setattr(self, "_x", v)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("object.__setattr__", "setattr") \
                    and len(node.args) == 3 and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in ("self", "cls") and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                out.add(node.args[1].value)
        return {n for n in out if _private(n)}

    def _external(self, module: _Module, class_name: str) -> bool:
        """Is this class built on a base from outside the package and the standard library?"""
        key = (module.name, class_name)
        if key in self._external_memo:
            return self._external_memo[key]
        self._external_memo[key] = False  # a cycle of bases is not external
        result = any(self._external_base(module, base) for base in module.classes[class_name].bases)
        self._external_memo[key] = result
        return result

    def _external_base(self, module: _Module, base: ast.expr) -> bool:
        while isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        if isinstance(base, ast.Attribute):  # enum.Enum, argparse.ArgumentParser
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value  # type: ignore[assignment]
            target = module.imports.get(root.id, root.id) if isinstance(root, ast.Name) else ""
            return not _stdlib_or_builtin(target.split(".")[0])
        if not isinstance(base, ast.Name):
            return True
        if base.id in module.classes and module.classes[base.id].name == base.id:
            return self._external(module, base.id)
        target = module.imports.get(base.id)
        if target is None:  # a builtin (object, Exception), or a function's parameter (vLLM's runner class)
            return not hasattr(builtins, base.id)
        source, _, attr = target.partition(":")
        if source in self.modules and attr in self.modules[source].classes:
            return self._external(self.modules[source], attr)
        return not _stdlib_or_builtin(source.split(".")[0])

    def _receiver_module(self, module: _Module, node: ast.expr) -> str | None:
        """The package module ``node`` names (an imported module alias or a dotted path), if any."""
        if isinstance(node, ast.Name):
            target = module.imports.get(node.id)
            return target if target in self.modules else None
        dotted = ast.unparse(node)
        return dotted if dotted in self.modules else None

    @staticmethod
    def _enclosing_classes(tree: ast.Module) -> dict[ast.AST, ast.ClassDef | None]:
        """Each node -> the innermost class whose body holds it (None: module level or a function)."""
        out: dict[ast.AST, ast.ClassDef | None] = {}

        def visit(node: ast.AST, cls: ast.ClassDef | None) -> None:
            for child in ast.iter_child_nodes(node):
                out[child] = cls
                visit(child, child if isinstance(child, ast.ClassDef) else cls)

        visit(tree, None)
        return out

    def reach_ins(self) -> list[str]:
        """``module:line: what`` for each reach-in, in module and line order."""
        found: list[tuple[str, int, str]] = []
        for module in self.modules.values():
            enclosing = self._enclosing_classes(module.tree)
            for node in ast.walk(module.tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omni_cache"):
                    for a in node.names:
                        if _private(a.name) and node.module != module.name:
                            found.append((module.name, node.lineno, f"imports {node.module}.{a.name}"))
                    continue
                access = self._access(node)
                if access is None:
                    continue
                receiver, name = access
                if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                    continue
                if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) \
                        and receiver.func.id == "super":
                    continue
                target = self._receiver_module(module, receiver)
                if target is not None:
                    if target != module.name and name in self.module_privates.get(target, ()):
                        found.append((module.name, node.lineno, f"{ast.unparse(receiver)}.{name}"))
                    continue
                owners = self.owners.get(name)
                cls = enclosing.get(node)
                # its own class's private (``other._x`` in ``__eq__``), or a module function's use of
                # a private of the module's own classes (``events.layout_rows``)
                own = name in self._members(cls, methods=True) if cls is not None else module.name in (owners or ())
                if owners and not own:
                    where = ", ".join(sorted(owners)[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
                    found.append((module.name, node.lineno, f"{ast.unparse(receiver)}.{name} (private to {where})"))
        return [f"{m}:{line}: {what}" for m, line, what in sorted(set(found))]

    @staticmethod
    def _access(node: ast.AST) -> tuple[ast.expr, str] | None:
        if isinstance(node, ast.Attribute) and _private(node.attr):
            return node.value, node.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _STRING_ACCESS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            return node.args[0], node.args[1].value
        return None


def test_no_module_reaches_into_another_class_private_members() -> None:
    sources = package_sources()
    assert "omni_cache.runtime.manager" in sources and "omni_cache.harness.bench.breakdown" in sources
    assert PrivateAccessChecker(sources).reach_ins() == []


_OWNER = '''
import sys
from collections import namedtuple
class Lock:
    _spare = 0
    def __init__(self):
        self._inner = object()
        object.__setattr__(self, "_frozen", 1)
    def _helper(self): ...
    def __eq__(self, other):
        return self._inner is other._inner          # its own class: allowed
def _module_helper(): ...
def peek(lock):
    return lock._inner                               # a module function, its own class: allowed
class Sibling:
    def go(self, lock):
        return lock._inner                           # another class, even in the same module
P = namedtuple("P", "a")
'''
_USER = '''
import sys
import omni_cache.owner as owner_module
from omni_cache import owner
from omni_cache.owner import Lock, _module_helper
class Sub(Lock):
    def go(self):
        return self._inner, super()._helper()         # a subclass through self/super: allowed
def f(lock, p, runner):
    lock._inner = 1
    getattr(lock, "_spare")
    lock._frozen
    lock._helper()
    owner_module._module_helper()
    owner._module_helper
    p._replace(a=1), p._asdict(), sys._getframe()    # not the package's privates
    runner._model_forward                            # a third-party base's method, overridden below
def build(base):
    class Runner(base):
        def _model_forward(self): ...
    return Runner
'''


def test_the_checker_flags_reach_ins_and_allows_what_the_rule_allows() -> None:
    found = PrivateAccessChecker({"omni_cache.owner": _OWNER, "omni_cache.user": _USER}).reach_ins()
    assert [f.split(": ", 1)[1].split(" (")[0] for f in found] == [
        "lock._inner",
        "imports omni_cache.owner._module_helper",
        "lock._inner",
        "lock._spare",
        "lock._frozen",
        "lock._helper",
        "owner_module._module_helper",
        "owner._module_helper",
    ]
    assert found[0] == "omni_cache.owner:17: lock._inner (private to omni_cache.owner)"
    assert all(f.startswith("omni_cache.user:") for f in found[1:])
