"""The documented fault-injection and observation seam of the manager.

Owns: ``FaultHooks``, a no-op base class. Pass an instance as
``OmniPrefixCacheManager(config, faults=...)``; the runtime calls each hook at
the named point, and a hook that raises is treated exactly like the real
failure at that point. Tests (and chaos runs in staging environments) inject
faults here instead of patching private names.

Hooks and what a raise there means:
  ``before_device_to_host(write)``  the device->host copy of ``write`` fails -> I8
  ``before_pool_write(write, key)`` the scatter of ``key`` into the pool fails -> I8
  ``committer_tick()``              the committer thread itself dies (raise any
                                    BaseException) -> every waiter is released with
                                    an error, never a hang (I8, I11)
  ``on_blocking(what)``             called right before every wait, copy and budget
                                    flush; I11 tests assert there that the state lock
                                    is not held by the calling thread

Upholds nothing itself: it is where tests break I8 and watch I11.
"""

from __future__ import annotations

from typing import Any

from omni_cache.runtime.interface import TensorName


class FaultHooks:
    """No-op hooks; override any of them."""

    def before_device_to_host(self, write: Any) -> None:
        """Right before ``write``'s rows are copied device -> host."""

    def before_pool_write(self, write: Any, key: TensorName) -> None:
        """Right before ``write``'s rows of ``key`` are scattered into the block pool."""

    def after_claim(self, slot: Any) -> None:
        """Right after a save claimed its staging page, before it copies rows into it."""

    def committer_tick(self) -> None:
        """At the top of every committer-thread iteration."""

    def on_blocking(self, what: str) -> None:
        """Right before a wait, a copy or a budget flush (``what`` says which)."""
