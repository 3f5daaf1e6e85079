"""The served engine: ``omni-cache serve`` (vLLM's OpenAI server with the cache and its delivery)
and ``omni-cache check-server`` (a running server checked over HTTP against the ground truth).

Owns: ``launch`` (the server's command line, the built-in ``tiny-llama`` model with its small
tokenizer), ``check`` (the HTTP workload, the file checks and the negative control) and
``scrape`` (the server's ``/metrics`` read over HTTP and parsed by prometheus_client).
Upholds: nothing itself; ``check`` verifies what the runtime and the delivery uphold.
"""
