"""The harness wing: what drives, checks and measures the cache, never on its path.

Owns: ``sim_engine`` (a simulated two-stage engine with ground truth, ``omni-cache simulate``),
``vllm_engine`` (drivers of real vLLM CPU engines: ``simulate --engine vllm``, TP/PP, KV
connectors), ``pipeline`` (a thinker-to-talker pipeline on real vLLM engines) and ``bench``
(the cache against a raw-copy floor). It may import the runtime (``omni_cache.runtime``) and
the vLLM integration (``omni_cache.integration``); neither imports it.

Upholds: nothing itself; it checks what the runtime upholds.
"""
