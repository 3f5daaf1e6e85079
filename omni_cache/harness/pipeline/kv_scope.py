"""``omni-cache pipeline --kv-connector example``: one worker-side KV connector among three engines.

Owns: ``scope_connector`` and ``CONNECTOR_METHODS``. vLLM keeps a worker's KV
connector in a process global (``vllm.distributed.kv_transfer.kv_transfer_state``)
that every model runner in the process consults at each step. The pipeline's
three engines share this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
worker each), so the thinker's connector (``OmniKVConnector`` over
``ExampleConnector``) would run inside the talker's and the ground-truth
thinker's steps too, with metadata their schedulers never built (measured
without this scope: the talker's first step fails vLLM's ``assert
kv_connector_metadata is not None`` in ``GPUModelRunner.execute_model``).
``scope_connector`` takes the global from the engine that installed it (built
last) and sets it only for the duration of that engine's own calls (``step``,
``reset_prefix_cache``, and its engine core's ``shutdown``, which shuts the
connector down); any other engine then steps without a connector. The
connector's scheduler side lives in that engine's scheduler and is untouched.
Upholds nothing itself; the tier's rows are checked by ``vllm_sim.tier_truth``.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["CONNECTOR_METHODS", "scope_connector"]

CONNECTOR_METHODS = ("step", "reset_prefix_cache")  # the engine calls that reach its worker's connector
# ... and the engine core's shutdown, which shuts the worker's connector down (the tier and the wrapped connector)


def scope_connector(llm: Any) -> Any:
    """Take the process's worker-side KV connector (``llm`` installed it) and install it only
    while ``llm``'s engine runs ``CONNECTOR_METHODS``; returns the connector."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state

    connector = state._KV_CONNECTOR_AGENT
    if connector is None:
        raise RuntimeError("scope_connector: no worker-side KV connector in this process (the engine has none)")
    state._KV_CONNECTOR_AGENT = None
    engine = llm.llm_engine
    for owner, name in [*((engine, n) for n in CONNECTOR_METHODS), (engine.engine_core, "shutdown")]:
        real = getattr(owner, name)

        @functools.wraps(real)
        def with_connector(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if state._KV_CONNECTOR_AGENT is not None:
                raise RuntimeError("another KV connector is installed in this process")
            state._KV_CONNECTOR_AGENT = connector
            try:
                return _real(*args, **kwargs)
            finally:
                state._KV_CONNECTOR_AGENT = None

        setattr(owner, name, with_connector)
    return connector
