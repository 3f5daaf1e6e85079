"""``omni-cache simulate --engine vllm``: the real vLLM CPU engine as the thinker stage.

Owns nothing itself: ``workload`` (presets and the request plan), ``truth``
(captured forward rows, check (a)), ``engine`` (the run, checks (b) and (c))
and ``report`` (summary, table, JSON). Imports vLLM only inside functions.
"""
