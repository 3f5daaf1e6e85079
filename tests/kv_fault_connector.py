"""A KV connector for the ``vllm`` tests: vLLM's ExampleConnector whose first load fails.

``FailingExampleConnector`` loads like ``ExampleConnector`` but reports the blocks of its first
load through ``get_block_ids_with_load_errors`` (vLLM's ``invalid_block_ids``), once; ``reported``
lists what it reported. Loaded by vLLM through ``kv_connector_module_path="kv_fault_connector"``
(tests/ is on ``sys.path``); it imports vLLM, so only ``vllm``-marked tests reach it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class FailingExampleConnector(ExampleConnector):
    reported: ClassVar[list[set[int]]] = []  # class-wide: the worker-side instance appends, the test reads

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        self._bad: set[int] = set()
        if not FailingExampleConnector.reported:
            for request in self._get_connector_metadata().requests:
                if not request.is_store:
                    self._bad = {int(s) // self._block_size for s in request.slot_mapping.tolist()}
                    break

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad = set(getattr(self, "_bad", ())), set()
        if bad:
            FailingExampleConnector.reported.append(bad)
        return bad
