"""The two contract errors of the omni prefix cache, and their kinds.

Owns: ``OmniPrefixCacheUnmatchError`` and ``OmniPrefixCacheStagingTimeoutError``.
Every contract violation (I1-I14 in spec/invariants.md) surfaces as one of these;
callers match on the phrases of spec/contract.md section 11, so the phrases live here as
constants and the raising code uses them instead of retyping them. Also owns
``ERROR_KINDS`` (a small fixed set derived from those phrases), ``error_kind`` (an error's
kind: the kind of the phrase that comes first in its message, so a chained error is filed
under its outermost cause) and ``ErrorTally`` (errors counted by kind: what a served engine
reports of the errors it contained). Upholds nothing itself:
these are what the others raise when an invariant's precondition is broken.
"""

from __future__ import annotations

import threading

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
PHRASE_TRIM = "cannot be trimmed"

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
    PHRASE_TRIM,
)


# Error kinds, by phrase: a fixed, small set (a metric label), in the order a report lists them.
KIND_BY_PHRASE: dict[str, str] = {
    PHRASE_NO_BLOCK_IDS: "invalid_hit",  # I5
    PHRASE_NOT_ALIGNED: "invalid_hit",
    PHRASE_NOT_SAVED: "step_id",  # I1
    PHRASE_OUTSIDE_SNAPSHOT: "step_id",  # I4
    PHRASE_CAPACITY: "staging",  # I10
    PHRASE_UNCONSUMED: "staging",  # I2
    PHRASE_SLOT_MAPPING: "slot_mapping",
    PHRASE_NOT_READABLE: "not_readable",  # I6/I7
    PHRASE_WRITE_FAILED: "write_failed",  # I8
    PHRASE_SHUT_DOWN: "shut_down",
    PHRASE_TRIM: "step_id",  # I14: a verdict that does not fit the saved step's rows
}
OTHER_KIND = "other"
ERROR_KINDS: tuple[str, ...] = (*dict.fromkeys(KIND_BY_PHRASE.values()), OTHER_KIND)


def error_kind(error: BaseException | str) -> str:
    """The kind of ``error``: a staging timeout is ``staging``; otherwise the kind of the contract
    phrase that comes first in the message (the outermost cause of a chained message), or
    ``other`` (a wait that timed out, a refused configuration, an error of no contract phrase)."""
    if isinstance(error, OmniPrefixCacheStagingTimeoutError):
        return "staging"
    message = str(error)
    found = [(at, phrase) for phrase in ALL_PHRASES if (at := message.find(phrase)) >= 0]
    return KIND_BY_PHRASE[min(found)[1]] if found else OTHER_KIND


class ErrorTally:
    """Errors counted by ``error_kind`` (every kind present, zero until seen); any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(ERROR_KINDS, 0)

    def record(self, error: BaseException | str) -> str:
        """Count ``error`` under its kind; return the kind."""
        kind = error_kind(error)
        with self._lock:
            self._counts[kind] += 1
        return kind

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class OmniPrefixCacheUnmatchError(RuntimeError):
    """Contract, config, or KV-occupancy error that must raise.

    Includes hit spans that resolve to absent slots (omni cache diverged from
    vLLM KV), a step id consumed twice or never saved, a step larger than the
    staging page, and a failed write. Do not pretend these were a miss.
    """


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """Save waited for a free staging slot and timed out (I2)."""
