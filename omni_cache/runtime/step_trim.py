"""Trimming a verify step: the rows that are not the request's leave the step.

Owns: ``trim_rows``, the pure half of ``OmniPrefixCacheManager.trim_step``. Given a saved
step's ``StepRows`` and, per request, how many of its rows the step keeps (a prefix of the
request's rows in the step), it returns the step's new ``StepRows`` and the step-row indices
of the rows dropped; the manager swaps the rows into the step context and vacates the dropped
rows' KV slots (contract section 4.14).

Why a step has rows to drop: with speculative decoding a verify step's forward computes a row
for every scheduled token, draft tokens included, before sampling decides which drafts the
target model accepts. The rows of rejected drafts (and of drafts past the end of a request
that stops inside its accepted tokens) are no rows of the request.

Upholds I14 with the manager: after a trim, materialize returns, per request, exactly the
kept rows (after its hit prefix, if the step serves one), in position order; a request the
verdict does not name keeps every row. A refused trim changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_cache.runtime.errors import PHRASE_OUTSIDE_SNAPSHOT, PHRASE_TRIM, OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import PrefixCacheWrite, StepRows, as_index
from omni_cache.runtime.interface import ReqId

__all__ = ["trim_rows"]


def trim_rows(rows: StepRows, keep: Mapping[ReqId, Any], *, what: str) -> tuple[StepRows, np.ndarray] | None:
    """The step's rows with request ``r``'s write cut to its first ``keep[r]`` rows, and the
    indices (into the step's rows) of the rows cut; ``None`` when nothing is cut.

    Raises ``OmniPrefixCacheUnmatchError`` (and changes nothing) when ``keep`` is not a mapping
    of ints, names a request outside the step ("outside the save snapshot"), or asks for a
    negative count or more rows than the request has in the step ("cannot be trimmed").
    """
    try:
        items = list(keep.items())
    except (AttributeError, TypeError) as exc:
        raise OmniPrefixCacheUnmatchError(f"{what}: the verdict must be a {{req_id: rows kept}} mapping, "
                                          f"got {keep!r}; nothing was trimmed") from exc
    counts: dict[ReqId, int] = {}
    for req_id, n in items:
        if (write := rows.write_of(req_id)) is None:
            raise OmniPrefixCacheUnmatchError(
                f"{what}: request {req_id!r} is {PHRASE_OUTSIDE_SNAPSHOT} (the step holds "
                f"{sorted(map(str, rows.req_ids))}); nothing was trimmed (I4)")
        try:
            count = as_index(f"{what}: rows kept of {req_id!r}", n)
        except TypeError as exc:
            raise OmniPrefixCacheUnmatchError(f"{exc}; nothing was trimmed") from exc
        if not 0 <= count <= write.num_rows:
            raise OmniPrefixCacheUnmatchError(
                f"{what}: request {req_id!r} {PHRASE_TRIM} to {count} rows: the step saved {write.num_rows} "
                f"(positions [{write.token_start}, {write.token_end})); a trim keeps a prefix of them and "
                "never adds rows; nothing was trimmed (I14)")
        counts[req_id] = count
    cut = [(w, counts[w.req_id]) for w in rows.writes if counts.get(w.req_id, w.num_rows) < w.num_rows]
    if not cut:
        return None
    new = {w.req_id: PrefixCacheWrite(w.req_id, w.row_start, w.row_start + n, w.token_start, w.token_start + n)
           for w, n in cut}
    writes = tuple(new.get(w.req_id, w) for w in rows.writes)
    dropped = np.concatenate([np.arange(w.row_start + n, w.row_end, dtype=np.int64) for w, n in cut])
    total = rows.ends[-1] if rows.ends else 0
    return StepRows(writes, total), dropped
