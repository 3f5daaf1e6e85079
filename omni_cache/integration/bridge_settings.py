"""The settings of one engine stage's cache: ``vllm_config.additional_config["omni_cache"]``.

Owns: ``CONFIG_KEY``, ``CONSUMERS`` and ``BridgeSettings.parse``, which reads the settings
mapping once, at engine start, and refuses a malformed one with one ``ValueError`` that names
the key (an unknown key, a flag that is not a bool, ``deferred_keys`` that is not a list of key
names, an unknown consumer). No vLLM import.

The settings: ``deferred_keys`` (the mm keys written on finish), ``needs_full_hidden_states``
(both override the model's own cache policy), ``eager`` (the manager's mode), ``all_tp_ranks``
(a cache on every TP rank of the last pipeline stage: for checking that the ranks agree) and
``consumer`` (who consumes the step ids: ``VllmRunnerBridge``'s docstring).

Upholds nothing at run time: a bad setting never reaches a step (refused at engine start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_cache.runtime.interface import ModelCachePolicy

__all__ = ["CONFIG_KEY", "CONSUMERS", "BridgeSettings"]

CONFIG_KEY = "omni_cache"
"""``vllm_config.additional_config[CONFIG_KEY]``: the stage's settings (a dict)."""
CONSUMERS = ("deliver", "discard", "queue")
_KEYS = frozenset({"all_tp_ranks", "consumer", "deferred_keys", "eager", "needs_full_hidden_states"})
_FLAGS = ("all_tp_ranks", "eager", "needs_full_hidden_states")


@dataclass(frozen=True)
class BridgeSettings:
    """One stage's parsed settings: the consumer asked for (``None``: decided at KV-cache
    initialisation), the policy that overrides the model's (``None``: the model's own) and the
    keyword arguments of the stage's ``PrefixCacheRunnerHooks``."""

    consumer: str | None = None
    policy_override: ModelCachePolicy | None = None
    hooks_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, settings: Any) -> BridgeSettings:
        """``settings`` (a mapping, or ``None``: every default) checked and parsed; ``ValueError``
        naming the first key that is wrong."""
        where = f"VllmRunnerBridge: additional_config['{CONFIG_KEY}']"
        if settings is not None and not isinstance(settings, dict):
            raise ValueError(f"{where} must be a mapping of settings, got {settings!r}")
        settings = dict(settings or {})
        unknown = set(settings) - _KEYS
        if unknown:
            raise ValueError(f"VllmRunnerBridge: unknown additional_config['{CONFIG_KEY}'] keys {sorted(unknown)}")
        for key in _FLAGS:
            if key in settings and not isinstance(settings[key], bool):
                raise ValueError(f"{where}['{key}'] must be true or false, got {settings[key]!r}")
        deferred = settings.get("deferred_keys", ())
        if isinstance(deferred, (str, bytes)) or not isinstance(deferred, (list, tuple, set, frozenset)) or not all(
                isinstance(k, str) and k for k in deferred):
            raise ValueError(f"{where}['deferred_keys'] must be a list of mm key names, got {deferred!r}")
        consumer = settings.get("consumer")
        if consumer is not None and consumer not in CONSUMERS:
            raise ValueError(f"{where}['consumer'] must be one of {', '.join(CONSUMERS)}, got {consumer!r}")
        policy = None
        if "deferred_keys" in settings or "needs_full_hidden_states" in settings:
            policy = ModelCachePolicy(needs_full_hidden_states=bool(settings.get("needs_full_hidden_states", True)),
                                      deferred_keys=frozenset(deferred))
        hooks_kwargs: dict[str, Any] = {}
        if "eager" in settings:
            hooks_kwargs["eager"] = settings["eager"]
        if settings.get("all_tp_ranks"):
            hooks_kwargs["all_tp_ranks"] = True
        return cls(consumer, policy, hooks_kwargs)
