"""Protects the dotted paths users put in configs and code: each documented one resolves.

What users write: vLLM's ``worker_cls="omni_cache.integration.vllm_worker.OmniCPUWorker"`` (or
``OmniGPUWorker``), ``kv_connector_module_path="omni_cache.integration.kv_tier"`` with
``kv_connector="OmniKVConnector"``, the seed's modules ``omni_cache.adapter``, ``omni_cache.manager``
and ``omni_cache.interface``, every public name of ``omni_cache.__all__``, and any other
``omni_cache.*`` path that README.md, docs/ or spec/ names (found by scanning them, so a newly
documented path is checked too). The worker and connector classes are built on first access on
top of vLLM's own classes, so resolving them needs vLLM: that half is marked ``vllm`` and resolves
them the way vLLM does (``import_module`` + ``getattr``, vLLM's ``resolve_obj_by_qualname``).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import omni_cache

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "spec").glob("*.md"))]

# Built lazily on a vLLM base class: resolving these imports vLLM.
NEEDS_VLLM = {
    "omni_cache.integration.vllm_worker.OmniCPUWorker": "vllm.v1.worker.cpu_worker.CPUWorker",
    "omni_cache.integration.vllm_worker.OmniGPUWorker": "vllm.v1.worker.gpu_worker.Worker",
    "omni_cache.integration.kv_tier.OmniKVConnector":
        "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1",
}
SEED_MODULES = ("omni_cache.adapter", "omni_cache.manager", "omni_cache.interface")


def documented_paths() -> set[str]:
    """Every ``omni_cache.x.y`` path README.md, docs/*.md and spec/*.md name."""
    found: set[str] = set()
    for doc in DOCUMENTS:
        found |= set(re.findall(r"\bomni_cache(?:\.[A-Za-z_]\w*)+", doc.read_text(encoding="utf-8")))
    return found


def resolve(path: str) -> Any:
    """The object ``path`` names: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but imports something missing: not a wrong path
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_the_documents_name_the_config_paths_this_file_checks() -> None:
    found = documented_paths()
    assert {"omni_cache.integration.vllm_worker.OmniCPUWorker", "omni_cache.integration.vllm_worker.OmniGPUWorker",
            "omni_cache.integration.kv_tier", *SEED_MODULES} <= found
    assert len(found) > 20  # the scan reads the documents


def test_every_documented_path_resolves() -> None:
    wrong = {}
    for path in sorted(documented_paths() - set(NEEDS_VLLM)):
        try:
            resolve(path)
        except (ImportError, AttributeError) as exc:
            wrong[path] = f"{type(exc).__name__}: {exc}"
    assert wrong == {}
    with pytest.raises(AttributeError):  # and a wrong one would be caught
        resolve("omni_cache.integration.vllm_worker.NoSuchWorker")
    with pytest.raises((ImportError, AttributeError)):
        resolve("omni_cache.no_such_module.Thing")


def test_public_names_and_the_seed_paths_import() -> None:
    for name in omni_cache.__all__:
        assert getattr(omni_cache, name) is not None, name
    code = "from omni_cache import " + ", ".join(n for n in omni_cache.__all__ if n != "__version__")
    exec(compile(code, "<public names>", "exec"), {})
    for module_name in SEED_MODULES:
        module = importlib.import_module(module_name)
        assert module.__all__, module_name
        for name in module.__all__:  # the same object as the public name
            assert getattr(module, name) is getattr(omni_cache, name), f"{module_name}.{name}"


def test_config_modules_import_without_vllm_and_name_their_lazy_classes() -> None:
    """The modules behind ``worker_cls`` and ``kv_connector_module_path`` import with vLLM blocked,
    and their module ``__getattr__`` knows the lazy class names (a typo there would only show
    at engine start)."""
    modules = sorted({p.rsplit(".", 1)[0] for p in NEEDS_VLLM})
    code = (
        "import importlib, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {modules!r}:\n"
        "    m = importlib.import_module(name)\n"
        "    assert callable(getattr(m, '__getattr__', None)), name\n"
        f"for path in {sorted(NEEDS_VLLM)!r}:\n"
        "    mod, attr = path.rsplit('.', 1)\n"
        "    try:\n"
        "        getattr(importlib.import_module(mod), attr)\n"
        "    except ImportError as exc:\n"
        "        assert 'blocked' in str(exc), (path, exc)\n"
        "        print('LAZY', path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(line.split()[1] for line in out.stdout.splitlines()) == sorted(NEEDS_VLLM)


@pytest.mark.vllm
def test_config_paths_resolve_the_way_vllm_resolves_them() -> None:
    from vllm_support import require_vllm

    require_vllm()
    from vllm.utils.import_utils import resolve_obj_by_qualname

    for path, base_path in NEEDS_VLLM.items():
        module_name, attr = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), attr)  # the KV connector factory's lookup
        assert resolve_obj_by_qualname(path) is cls  # the worker_cls lookup
        base = resolve_obj_by_qualname(base_path)
        assert isinstance(cls, type) and issubclass(cls, base), (path, base_path)
    documented = documented_paths() & set(NEEDS_VLLM)
    assert documented == {p for p in NEEDS_VLLM if "kv_tier" not in p}  # the connector is named by module + class
