"""What a delivered file holds for a prompt given as ``prompt_embeds`` (no prompt token ids).

Protected: every row is in the file and ``token_ids`` is empty, with or without the output tokens'
rows -- as vLLM's own connector writes a prompt-only file -- never vLLM's placeholder zeros (it
counts an embeds prompt in zeros in ``all_token_ids``) presented as token ids.
"""

from __future__ import annotations

import pytest
import torch
from cache_helpers import E, started
from delivery_helpers import read
from test_delivery_worker import worker  # noqa: F401  (fixture)

from omni_cache import PrefixCacheRequestEvent
from omni_cache.integration.delivery import DeliveryPlan


@pytest.mark.parametrize("include", [False, True], ids=["prompt", "include_output_tokens"])
def test_a_prompt_embeds_request_gets_its_rows_and_no_token_ids_never_placeholder_zeros(worker, include: bool) -> None:  # noqa: F811
    """A prompt given as prompt_embeds has no token ids (vLLM counts it in placeholder zeros in
    ``all_token_ids``): the file holds every row and an empty ``token_ids``, with or without the output
    tokens, as vLLM's own connector writes a prompt-only file -- never zeros presented as ids."""
    w = worker()
    w.admit("a", 4, include=include, embeds=True)
    parts = [w.step([started("a")], [("a", [1, 2], 0, 4)])]
    if include:
        parts.append(w.step([PrefixCacheRequestEvent("a", E.EXTENDED)], [("a", [1, 2], 4, 5)]))
        w.delivery.begin_step(DeliveryPlan(finished=(("a", (0, 0, 0, 0, 9)),)), {})  # the scheduler's view
        w.delivery.finish_step()
    assert w.results()["a"].num_tokens == (5 if include else 4)
    data = read(w.path("a"))
    assert torch.equal(data["hidden_states"], torch.cat(parts)) and data["token_ids"].tolist() == []
    w.assert_every_step_consumed_once()
