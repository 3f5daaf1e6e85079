"""Ground truth of a speculative-decoding run: which captured rows are rows of the request.

Owns: ``SpecCapture``, the ``ForwardCapture`` of ``simulate --engine vllm --speculative``.
With speculative decoding a forward feeds draft tokens the verifier may reject, and the next
forward of the request computes those positions again with its accepted tokens, so a
position's token is known only once a later forward starts past it (vLLM rolls
``num_computed_tokens`` back to the accepted tokens) or the request's final output is known.
``SpecCapture`` therefore keeps a request's fed tokens from its last forward on as tentative
(a later forward that starts at or before them replaces them; prompt positions never change),
keeps every row it served, and after the run checks, against each request's final tokens
(prompt and output, from vLLM's ``RequestOutput``), independently of the bridge's verdict:

- every row the cache served as a step's own row is a row of the request: its position is
  below the request's last token (one row per token but the last, as without speculation),
  and every token the forward fed up to it, from the step's first position, is the request's
  token there (a rejected draft, or a token past a stop, fails this);
- every finished request got a row at every position but the last (a verdict that cut an
  accepted token's row leaves a position no later step computes again).

Check (a) (every served row bit for bit the forward's) is ``ForwardCapture.check_step``; a hit
row whose slot holds a rejected draft's row fails its token-prefix check there. Upholds
nothing itself: it checks I14 from outside.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from omni_cache.harness.vllm_engine.truth import ForwardCapture

__all__ = ["SpecCapture"]


@dataclass(frozen=True)
class _Served:
    """A step's own rows of one request the consumer got: positions ``[start, last]``."""

    rid: str
    engine_step: int
    start: int
    last: int
    fed: tuple[int, ...]  # the forward's tokens for the request from ``start`` on


class SpecCapture(ForwardCapture):
    """``ForwardCapture`` with tentative tokens and the I14 checks (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._fed: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}  # (rid, step) -> (start, tokens)
        self._served: list[_Served] = []
        self.served_rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)  # every served row, by position
        self.rows_of_tokens_checked = 0

    def _feed_tokens(self, engine_step: int, rid: str, start: int, inputs: list[int]) -> None:
        toks = self.tokens.setdefault(rid, [])
        floor = max(start, self.prompt_len.get(rid, 0))
        if len(toks) > floor:  # fed by an earlier forward, tentatively (drafts): this one replaces them
            del toks[floor:]
            del self._hash[rid][floor:]
        self._fed[(rid, engine_step)] = (start, tuple(inputs))
        super()._feed_tokens(engine_step, rid, start, inputs)

    def _keep_served(self, rid: str, engine_step: int, p: int, row: torch.Tensor, own: bool) -> None:
        super()._keep_served(rid, engine_step, p, row, own)
        self.served_rows[rid][p] = row.detach().clone()
        if own:
            start, fed = self._fed[(rid, engine_step)]
            last = self._served[-1] if self._served else None
            if last is not None and (last.rid, last.engine_step) == (rid, engine_step):
                self._served[-1] = _Served(rid, engine_step, start, p, fed)
            else:
                self._served.append(_Served(rid, engine_step, start, p, fed))

    def check_tokens(self, final: dict[str, list[int]], finished: set[str]) -> None:
        """The I14 checks against the final tokens of each request (``finished``: those that ended
        by their own stop, not aborted: they must have got every row)."""
        with self._lock:
            for s in self._served:
                tokens = final.get(s.rid)
                if tokens is None:
                    self._fail(s.engine_step, s.rid, "hidden", s.last, "served rows of a request whose final tokens "
                               "are unknown")
                    continue
                if s.last > len(tokens) - 2:
                    self._fail(s.engine_step, s.rid, "hidden", s.last,
                               f"served a row at position {s.last}, past the request's last input token "
                               f"(its {len(tokens)} tokens have rows at 0..{len(tokens) - 2})")
                    continue
                for p in range(s.start, s.last + 1):
                    if s.fed[p - s.start] != tokens[p]:
                        self._fail(s.engine_step, s.rid, "hidden", p,
                                   f"served the row of token {s.fed[p - s.start]} at position {p}, where the "
                                   f"request's token is {tokens[p]} (a rejected draft's row)")
                        break
                    self.rows_of_tokens_checked += 1
            for rid in sorted(finished):
                want = len(final[rid]) - 1
                missing = [p for p in range(want) if p not in self.served_rows.get(rid, {})]
                if missing:
                    self._fail(None, rid, "hidden", missing[0],
                               f"the next stage never got the rows of positions {missing[:4]}"
                               f"{'...' if len(missing) > 4 else ''} ({len(missing)} of {want})")
