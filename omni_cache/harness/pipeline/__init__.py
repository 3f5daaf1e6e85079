"""``omni-cache pipeline``: a two-stage omni pipeline on real vLLM engines.

A vLLM thinker (automatic prefix caching on, the omni prefix cache installed
through ``worker_cls``) hands each finished request's full-prompt hidden states,
materialized through the cache, to a vLLM talker engine as ``prompt_embeds``.
The talker's tokens and logprobs are compared with the same workload run with
prefix caching off on the thinker (ground truth), and two negative controls
must be caught; a third thinker, prefix caching without the cache, measures the upper
bound of what prefix caching buys. Modules: ``workload`` (presets, the plan), ``stages``
(the thinker's engines and stage), ``talker`` (the talker's), ``drive`` (a run step by
step; the runs in lockstep), ``parallel`` and ``worker_stage`` (a thinker
on ``tp x pp`` worker processes: the driver's and the workers' halves),
``kv_scope`` (one process-wide KV connector among the engines), ``run`` (the
engines, the repeats and the measurements), ``checks`` (the comparisons and the
controls), ``report``.
Nothing here imports vLLM at module scope. Checks I1 (every saved step id
materialized exactly once), I4, I6 and I7 (served rows are the forward's rows
of the same token prefix) from outside, end to end through the next stage.

Upholds nothing itself: the pipeline checks I1, I4, I6 and I7 from outside.
"""
