"""The reference interface's import path ``omni_cache.manager``: ``OmniPrefixCacheManager``.

Owns nothing: the manager is defined in ``omni_cache.runtime.manager``; this module keeps the
path that callers of the reference import from. Upholds: nothing itself.
"""

from __future__ import annotations

from omni_cache.runtime.manager import OmniPrefixCacheManager

__all__ = ["OmniPrefixCacheManager"]
