"""vLLM worker and model-runner subclasses that run the omni prefix cache.

Owns: ``OmniCPUWorker`` (install it with ``LLM(..., worker_cls=
"omni_cache.integration.vllm_worker.OmniCPUWorker")``) and ``OmniCPUModelRunner``,
thin subclasses of vLLM's ``CPUWorker`` / ``CPUModelRunner`` whose overrides
only call ``VllmRunnerBridge`` (``omni_cache.integration.vllm_bridge``), where
the logic is. The classes are built on first attribute access (PEP 562
``__getattr__``), so importing this module never imports vLLM: the package rule
"no vLLM import at module scope" holds, and vLLM's own ``worker_cls`` lookup
(``importlib.import_module`` + ``getattr``) still finds them.

Upholds the DESIGN section 2 call order on the real runner: the gate at KV-cache
initialisation (before the KV cache is allocated), ``begin_step`` before
``_update_states`` drops finished requests, ``after_forward`` with the real
hidden states and block table; warmup and dummy runs are never fed (only a
forward inside ``execute_model`` is).
"""

from __future__ import annotations

import functools
from typing import Any

_LAZY = ("OmniCPUModelRunner", "OmniCPUWorker")  # built by __getattr__ on first access
__all__: list[str] = []


@functools.cache
def _build_classes() -> dict[str, type]:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from omni_cache.integration.vllm_bridge import VllmRunnerBridge

    class OmniCPUModelRunner(CPUModelRunner):  # type: ignore[misc, valid-type]
        """vLLM's V1 CPU model runner with the omni prefix cache wired in."""

        def __init__(self, vllm_config: Any, device: Any) -> None:
            super().__init__(vllm_config, device)
            self.omni_cache = VllmRunnerBridge.from_vllm_config(vllm_config)
            self._omni_in_step = False

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.omni_cache.on_model_loaded(self.get_model())

        def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
            self.omni_cache.on_kv_cache_initialized(self.vllm_config, kv_cache_config)
            super().initialize_kv_cache(kv_cache_config, *args, **kwargs)

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
            self.omni_cache.begin_step(scheduler_output)
            self._omni_in_step = True
            try:
                return super().execute_model(scheduler_output, intermediate_tensors)
            finally:
                self._omni_in_step = False

        def _model_forward(self, input_ids: Any = None, positions: Any = None, *args: Any, **kwargs: Any) -> Any:
            out = super()._model_forward(input_ids, positions, *args, **kwargs)
            if self._omni_in_step:
                self._omni_in_step = False  # one forward per step is fed
                self.omni_cache.after_forward_v1(self, out, input_ids, positions)
            return out

    class OmniCPUWorker(CPUWorker):  # type: ignore[misc, valid-type]
        """vLLM's CPU worker whose model runner is ``OmniCPUModelRunner``."""

        def init_device(self) -> None:
            super().init_device()
            if getattr(self, "use_v2_model_runner", False):
                raise RuntimeError(
                    "OmniCPUWorker: vLLM chose Model Runner V2, which has no CPU build of this wiring; "
                    "set VLLM_USE_V2_MODEL_RUNNER=0"
                )
            self.model_runner = OmniCPUModelRunner(self.vllm_config, self.device)

    return {"OmniCPUModelRunner": OmniCPUModelRunner, "OmniCPUWorker": OmniCPUWorker}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _build_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
