"""``omni-cache simulate --engine vllm``: the real vLLM CPU engine as the thinker stage.

Owns nothing itself: ``workload`` (presets and the request plan), ``truth``
(captured forward rows, check (a)), ``engine`` (the run, checks (b) and (c)),
``parallel`` and ``worker_probe`` (the run on TP/PP worker processes),
``promises`` (KV blocks and preemptions the run must deliver) and ``report``
(summary, table, JSON). Imports vLLM only inside functions.

Upholds nothing itself: the run checks I1, I4, I6, I7 and I9 from outside.
"""
