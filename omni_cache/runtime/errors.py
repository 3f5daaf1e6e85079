"""The two contract errors of the omni prefix cache.

Owns: ``OmniPrefixCacheUnmatchError`` and ``OmniPrefixCacheStagingTimeoutError``.
Every contract violation (I1-I13 in spec/invariants.md) surfaces as one of these;
callers match on the phrases of spec/contract.md section 11, so the phrases live here as
constants and the raising code uses them instead of retyping them. Upholds nothing itself:
these are what the others raise when an invariant's precondition is broken.
"""

from __future__ import annotations

# Phrases callers match on (spec/contract.md section 11). Raising code must embed these.
PHRASE_NO_BLOCK_IDS = "carries no block_ids"
PHRASE_NOT_ALIGNED = "not block aligned"
PHRASE_NOT_SAVED = "already consumed or never saved"
PHRASE_OUTSIDE_SNAPSHOT = "outside the save snapshot"
PHRASE_CAPACITY = "staging capacity is"
PHRASE_UNCONSUMED = "unconsumed step contexts"
PHRASE_SLOT_MAPPING = "slot mapping covers"
PHRASE_NOT_READABLE = "is not readable"
PHRASE_WRITE_FAILED = "write failed"
PHRASE_SHUT_DOWN = "the manager was shut down"

ALL_PHRASES: tuple[str, ...] = (
    PHRASE_NO_BLOCK_IDS,
    PHRASE_NOT_ALIGNED,
    PHRASE_NOT_SAVED,
    PHRASE_OUTSIDE_SNAPSHOT,
    PHRASE_CAPACITY,
    PHRASE_UNCONSUMED,
    PHRASE_SLOT_MAPPING,
    PHRASE_NOT_READABLE,
    PHRASE_WRITE_FAILED,
    PHRASE_SHUT_DOWN,
)


class OmniPrefixCacheUnmatchError(RuntimeError):
    """Contract, config, or KV-occupancy error that must raise.

    Includes hit spans that resolve to absent slots (omni cache diverged from
    vLLM KV), a step id consumed twice or never saved, a step larger than the
    staging page, and a failed write. Do not pretend these were a miss.
    """


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """Save waited for a free staging slot and timed out (I2)."""
