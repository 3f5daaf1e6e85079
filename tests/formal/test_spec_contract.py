"""spec/contract.md, spec/protocol.md and spec/README.md keep up with the code.

The contract is prose, but its skeleton is checked against the code: every
public call of ``OmniPrefixCacheManager`` has a section whose heading carries
its real parameter list; every error phrase callers match on (``runtime.errors``) is in the
errors table (I1, I2, I4..I8, I10 are the invariants those phrases report);
every ``PrefixCacheConfig`` field is in the config table with its real
default; every ``ModelCachePolicy`` member and every adapter type's signature
is there; every invariant I1..I14 is cited; the spec index links every file.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_cache.integration import adapter
from omni_cache.runtime.errors import ALL_PHRASES
from omni_cache.runtime.interface import ModelCachePolicy, PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager

SPEC = Path(__file__).resolve().parents[2] / "spec"
CONTRACT = (SPEC / "contract.md").read_text(encoding="utf-8")
HEADING = re.compile(r"^### [\d.]+ `(\w+)\(([^)]*)\)", re.M)


def _param_text(params: list[inspect.Parameter]) -> str:
    """``a, b, *, c=None`` as the contract writes a signature (no annotations)."""
    out: list[str] = []
    star = False
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def _section(title_start: str) -> str:
    start = CONTRACT.index(f"\n## {title_start}")
    end = CONTRACT.find("\n## ", start + 1)
    return CONTRACT[start : end if end != -1 else None]


def test_every_public_manager_call_has_a_section_with_its_signature() -> None:
    headings = {name: params for name, params in HEADING.findall(CONTRACT)}
    public = _public_methods(OmniPrefixCacheManager)
    assert public == set(headings), "contract.md section 4 must have one heading per public call"
    for name in sorted(public):
        params = list(inspect.signature(getattr(OmniPrefixCacheManager, name)).parameters.values())[1:]
        documented = re.sub(r":[^,=]+", "", headings[name]).replace(" ", "")
        expected = _param_text(params).replace(" ", "")
        # Defaults are optional in headings: compare names and the keyword-only marker.
        assert re.sub(r"=[^,]+", "", documented) == re.sub(r"=[^,]+", "", expected), name


def test_constructor_signature_is_documented() -> None:
    params = list(inspect.signature(OmniPrefixCacheManager.__init__).parameters.values())[1:]
    assert f"OmniPrefixCacheManager({_param_text(params)})" in CONTRACT


@pytest.mark.parametrize("phrase", ALL_PHRASES)
def test_every_error_phrase_is_in_the_errors_table(phrase: str) -> None:
    assert f'| "{phrase}" |' in _section("11. Errors")
    # ... and in bold where section 4 describes the call that raises it.
    assert f'**"{phrase}"**' in " ".join(_section("4. ").split())


def _human_default(value: Any) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


def test_every_config_field_is_documented_with_its_default() -> None:
    table = _section("7. `PrefixCacheConfig`")
    for f in dataclasses.fields(PrefixCacheConfig):
        default = "required" if f.default is dataclasses.MISSING else _human_default(f.default)
        assert f"| `{f.name}` | {default} |" in table, f.name
    assert ("from_vllm_config(*, num_blocks, block_size, scheduler_config=None,\n  model_config=None, "
            "output_group_id=0)") in table


def test_every_policy_member_is_documented() -> None:
    table = _section("8. `ModelCachePolicy`")
    members = {f.name for f in dataclasses.fields(ModelCachePolicy)}
    members |= {
        n for n, v in vars(ModelCachePolicy).items()
        if not n.startswith("_") and (isinstance(v, (property, classmethod)) or callable(v))
    }
    for name in sorted(members):
        assert f"| `{name}" in table, name


def _dataclass_signature(cls: type) -> str:
    parts = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            parts.append(f"{f.name}={f.default!r}")
        elif f.default_factory is not dataclasses.MISSING:
            parts.append(f"{f.name}={f.default_factory()!r}")
        else:
            parts.append(f.name)
    return f"{cls.__name__}({', '.join(parts)})"


def test_adapter_types_are_documented_with_their_signatures() -> None:
    section = _section("10. Adapter types")
    for cls in (adapter.PrefixCacheRequestEvent, adapter.PrefixCacheStep, adapter.PrefixCacheWrite,
                adapter.PrefixCacheWriteLayout):
        assert f"`{_dataclass_signature(cls)}`" in section, cls.__name__
    kinds = ", ".join(f"`{k.name}`" for k in adapter.PrefixCacheEventKind)
    assert issubclass(adapter.PrefixCacheEventKind, enum.Enum)
    assert f"`PrefixCacheEventKind`: {kinds}." in section
    scheduler_adapter = getattr(adapter, "PrefixCacheSchedulerAdapter", None)
    if scheduler_adapter is None:
        pytest.skip("omni_cache.integration.adapter.PrefixCacheSchedulerAdapter is not in the code yet")
    for name in sorted(_public_methods(scheduler_adapter)):
        assert f"`{name}(" in section, name


def test_every_invariant_is_cited() -> None:
    cited = set(re.findall(r"\bI(\d+)\b", CONTRACT))
    assert {str(i) for i in range(1, 15)} <= cited  # I1..I14


def test_resumed_rule_and_lock_rule_are_stated() -> None:
    assert "A STARTED **or RESUMED** event with `hit_end > 0` is a hit" in CONTRACT
    assert "`[0, hit_end + scheduled)`" in CONTRACT
    assert "**leaf** lock" in _section("3. The lock rule")


def test_spec_index_links_every_spec_file() -> None:
    index = (SPEC / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    present = {p.name for p in SPEC.glob("*.md")} - {"README.md"}
    assert linked == present


def test_protocol_diagram_names_every_protocol_call() -> None:
    protocol = (SPEC / "protocol.md").read_text(encoding="utf-8")
    (diagram,) = re.findall(r"```mermaid\n(.*?)```", protocol, flags=re.S)
    assert diagram.startswith("sequenceDiagram")
    assert ";" not in diagram, "';' ends a statement in a Mermaid sequence diagram"
    for call in ("new_step_starts(", "save_outputs(", "materialize(", "discard_step("):
        assert call in protocol


def test_stats_keys_are_exactly_the_documented_ones() -> None:
    """Every key of ``stats()`` is in contract 4.7 and every documented key is there, also after a
    tier restore (a counter added on first use would be missed by a fresh manager's keys)."""
    from omni_cache.runtime.tier_rows import restore_rows

    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=2, block_size=2), eager=True)
    try:
        keys = set(manager.stats())
        restore_rows(manager, torch.tensor([0, 1]), {"hidden": torch.ones(2, 4)})
        after = manager.stats()
        assert after["tier_restores"] == 1 and set(after) == keys
    finally:
        manager.shutdown()
    start = CONTRACT.index("### 4.7 `stats()")
    documented = set(re.findall(r"`(\w+)`", CONTRACT[start : CONTRACT.index("\n### ", start + 1)]))
    assert keys <= documented, f"undocumented stats keys: {sorted(keys - documented)}"
    assert documented - keys <= {"stats", "dict", "file", "line", "None"}, sorted(documented - keys)


def test_every_public_name_of_the_contract_modules_is_importable_from_the_package_root() -> None:
    """The contract's promise: everything in ``omni_cache.runtime.interface``, ``omni_cache.integration.adapter``,
    ``omni_cache.runtime.errors`` and ``omni_cache.runtime.manager`` is importable from ``omni_cache`` and listed
    in its ``__all__`` (``PrefixCacheRequestOwner`` was missing)."""
    import omni_cache
    from omni_cache.runtime import errors, interface

    public = {*adapter.__all__, *interface.__all__, "OmniPrefixCacheManager",
              *(name for name in vars(errors) if name.startswith("OmniPrefixCache"))}
    missing = sorted(name for name in public if getattr(omni_cache, name, None) is None)
    assert not missing, f"not importable from omni_cache: {missing}"
    assert not public - set(omni_cache.__all__), sorted(public - set(omni_cache.__all__))
    for name in public:
        module = adapter if name in adapter.__all__ else interface if name in interface.__all__ else None
        if module is not None:
            assert getattr(omni_cache, name) is getattr(module, name), name
