"""Splitting a step's outputs and snapshotting what its materialize needs.

Owns: ``classify_outputs`` (immediate / deferred / leftover), ``host_copy`` for
leftover values, and the ``StepContext`` the manager keeps per unconsumed
step id.

Upholds I4 (snapshot): everything materialize reads is either in the claimed
staging page, in host copies taken at save, or in planned reads pinned at save;
nothing refers to the caller's live, reusable buffers, nor to their autograd
graph (per-token rows are detached; leftovers are copied by type, detached, and a
leftover that cannot be copied faithfully is refused before anything is claimed).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import StepRows
from omni_cache.runtime.interface import ModelCachePolicy, ReqId, StepId, TensorName
from omni_cache.runtime.tenancy import PlannedRead
from omni_cache.runtime.validation import RowSig


@dataclass
class SplitOutputs:
    """A step's outputs by write path; per-token rows already sliced to unpadded."""

    immediate: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    deferred: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    leftover: dict[TensorName, Any] = field(default_factory=dict)
    # Per-token key -> (dtype, row shape) of its rows, read once here; every later row check
    # of the save (staging page, pool tensor, landing) compares these tuples, not the tensors.
    sigs: dict[TensorName, RowSig] = field(default_factory=dict)


def _is_token_major(shape: torch.Size, num_unpadded: int, num_padded: int) -> bool:
    """A tensor's shape of >= 2 dims whose dim 0 is the unpadded or the padded token count."""
    return len(shape) >= 2 and shape[0] in (num_unpadded, num_padded)


def classify_outputs(
    policy: ModelCachePolicy,
    hidden_states: torch.Tensor | None,
    mm_outputs: dict[TensorName, Any],
    num_unpadded: int,
    num_padded: int,
) -> SplitOutputs:
    """Split a step's outputs; per-token rows are detached: no autograd through the cache."""
    split = SplitOutputs()
    sigs = split.sigs
    hidden_key = policy.hidden_key
    if hidden_key is not None and hidden_states is not None:
        _check_dense(hidden_key, hidden_states)
        shape = hidden_states.shape
        split.immediate[hidden_key] = _unpadded_rows(hidden_states, shape, num_unpadded)
        sigs[hidden_key] = (hidden_states.dtype, shape[1:])
    for key, value in mm_outputs.items():
        if isinstance(value, torch.Tensor) and value.is_nested:  # a strided nested tensor has no ``shape``
            if value.dim() >= 2 and value.size(0) in (num_unpadded, num_padded):
                _check_dense(key, value)  # raises: a nested tensor's rows are not rows of one width
            split.leftover[key] = value
        elif isinstance(value, torch.Tensor) and _is_token_major(shape := value.shape, num_unpadded, num_padded):
            _check_dense(key, value)
            target = split.deferred if key in policy.deferred_keys else split.immediate
            target[key] = _unpadded_rows(value, shape, num_unpadded)
            sigs[key] = (value.dtype, shape[1:])
        else:
            split.leftover[key] = value
    return split


def _check_dense(key: TensorName, value: torch.Tensor) -> None:
    """Per-token rows are copied row by row: a sparse or a meta tensor (no rows, or no data) is
    refused here, before anything is claimed."""
    if value.layout is not torch.strided or value.is_meta or value.is_nested:
        kind = "meta" if value.is_meta else str(value.layout) if value.layout is not torch.strided else "nested"
        raise OmniPrefixCacheUnmatchError(
            f"save_outputs: per-token key {key!r} is a {kind} tensor; its rows must be a dense tensor with "
            "data (strided, not nested, not meta); nothing was claimed (I4)")


def _unpadded_rows(value: torch.Tensor, shape: torch.Size, n: int) -> torch.Tensor:
    """The first ``n`` rows, detached from autograd (no slice or detach when there is nothing to drop)."""
    rows = value if shape[0] == n else value[:n]
    return rows.detach() if rows.requires_grad else rows


def host_copy(value: Any) -> Any:
    """A host-side copy of a leftover value that shares no storage with ``value``, of the same type.

    Tensors are detached CPU copies; named tuples, tuples, lists, dicts (and their
    subclasses) and dataclasses are rebuilt with the same type and fields around
    copies of their items; anything else is deep-copied, the tensors it holds (in sets,
    containers, instances' attributes) as detached CPU copies. Raises whatever the copy
    raises (``copy_leftovers`` turns that into a refusal).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, tuple):
        items = [host_copy(v) for v in value]
        if type(value) is tuple:
            return tuple(items)
        if hasattr(value, "_fields"):  # a named tuple: positional fields
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, list):
        items = [host_copy(v) for v in value]
        if type(value) is list:
            return items
        same_list = copy.copy(value)  # keeps the subclass and its attributes
        same_list[:] = items
        return same_list
    if isinstance(value, dict):
        entries = {k: host_copy(v) for k, v in value.items()}
        if type(value) is dict:
            return entries
        same_dict = copy.copy(value)  # keeps OrderedDict / defaultdict(default_factory) / subclasses
        same_dict.clear()
        same_dict.update(entries)
        return same_dict
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        same = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(same, f.name, host_copy(getattr(value, f.name)))  # frozen ones too
        return same
    return _deepcopy_detached(value)


def _deepcopy_detached(value: Any) -> Any:
    """``copy.deepcopy(value)`` whose tensors are detached host copies wherever the copy meets them
    in sets, containers and instances' attributes (a plain deep copy keeps ``requires_grad`` and
    the device). Cycles and shared objects are copied as ``deepcopy`` copies them."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            memo[id(item)] = item.detach().to("cpu", copy=True)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
        elif type(item).__flags__ & _HEAP_TYPE and not isinstance(item, type):  # an instance of a class statement
            state = getattr(item, "__dict__", None)
            if isinstance(state, dict):
                todo.extend(state.values())
            for cls in type(item).__mro__:
                for name in cls.__dict__.get("__slots__", ()):
                    if isinstance(name, str) and hasattr(item, name):
                        todo.append(getattr(item, name))
    return copy.deepcopy(value, memo)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by a class statement (not a builtin type)


def copy_leftovers(leftover: dict[TensorName, Any]) -> dict[TensorName, Any]:
    """``host_copy`` of every leftover; one that cannot be copied faithfully is refused (before a claim)."""
    out = {}
    for key, value in leftover.items():
        try:
            out[key] = host_copy(value)
        except Exception as exc:
            raise OmniPrefixCacheUnmatchError(
                f"save_outputs: leftover mm key {key!r} ({type(value).__name__}) cannot be copied faithfully "
                f"for materialize ({type(exc).__name__}: {exc}); nothing was claimed and no step id issued (I4)"
            ) from exc
    return out


@dataclass(slots=True)
class StepContext:
    """Everything one step's materialize needs, snapshotted at save (I4)."""

    step_id: StepId
    staging_slot: Any
    saved_at: str
    # The layout's writes (immutable PrefixCacheWrite) in row order, validated at save.
    rows: StepRows
    # req -> the hit read planned at save (first step after STARTED/RESUMED with a hit).
    hits: dict[ReqId, PlannedRead]
    immediate_keys: tuple[TensorName, ...]
    immediate_write: Any
    deferred_rows: dict[TensorName, torch.Tensor]
    leftover: dict[TensorName, Any]
    hit_keys: tuple[TensorName, ...]
    caches_hidden: bool
    # CUDA events of the deferred rows' host copies (empty on CPU).
    host_events: list[Any] = field(default_factory=list)
    # The KV slot of every step row (the save's private copy): ``trim_step`` vacates the rows it cuts.
    slots_np: Any = None

    def planned_reads(self) -> list[PlannedRead]:
        return list(self.hits.values())
