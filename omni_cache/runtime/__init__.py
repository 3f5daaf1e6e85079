"""The runtime wing: the omni prefix cache itself.

Owns every piece of the cache and nothing else: the state tables (``states``), the staging
pool (``staging``), pool writes, their scheduling and the committer (``writes``,
``scheduling``, ``copier``), the block pool and KV-slot tenancy (``block_pool``,
``tenancy``), the read path (``reader``, ``step_outputs``),
input validation (``validation``), request identity and pending hits (``admissions``,
``hits``), the engine-facing value types (``events``), the public interface types and errors
(``interface``, ``errors``), the hidden-state tier (``tier``) and the manager that composes
them (``manager``), with its narrow port for the tier (``tier_rows``).

Layering: this package imports nothing of the project outside itself, and never vLLM. The
vLLM integration (``omni_cache.integration``) sits on top of it, the harness
(``omni_cache.harness``: simulated and real engines, the pipeline, the bench) on top of that,
and the command line (``omni_cache.cli``) last. ``tests/project/test_layering.py`` checks it from the
import graph. Importing this package costs nothing: its modules load when imported.

Upholds: nothing itself; each module names the invariants it upholds.
"""
