"""Model-based test of the adapter and the manager together: vLLM scheduler outputs against ground truth.

Owns: ``AdapterMachine``, tests/manager/test_manager_stateful.py's machine whose steps reach the manager
as vLLM scheduler outputs through a real ``PrefixCacheSchedulerAdapter``
(tests/adapter_transport.py), so every materialize checks against the ground truth what the
adapter made of the scheduler's fields. Beyond the base machine's rules it draws the shape of
the scheduler output: the step sequence as a numpy int, and a malformed scheduler output
(a float or string sequence, a count that is not an int, an entry without a request id, a
control that is not REPLACED) refused first -- changing nothing -- then retried (I13: the
retry is translated, never taken for a replay). REPLACED controls come early with their
lookup pending, or with the new admission's first new request, carrying that lookup or built
with the defaults (a complete miss: the new request must still carry its hit, I12). The
invariant ``adapter_follows_admissions``: the adapter's live ids are the admissions the
events leave live.

Invariants touched: I12, I13, and through the ground truth I4..I7 (as the base machine).
"""

from __future__ import annotations

import hypothesis.strategies as st
import manager_machine as base
from adapter_transport import REFUSALS, AdapterTransport
from hypothesis import event
from hypothesis.stateful import initialize, invariant, rule


class AdapterMachine(base.ManagerMachine):
    MODE = "eager"
    ADAPTER = True

    @initialize(**base.SETUP)
    def setup(self, **kwargs: object) -> None:  # type: ignore[override]
        super().setup(**kwargs)  # type: ignore[arg-type]
        self.transport = AdapterTransport(self.m, self.engine)
        self.engine.deliver = self.transport.deliver

    def _start(self, **kwargs: bool) -> None:  # type: ignore[override]
        super()._start(**kwargs)  # type: ignore[arg-type]
        if hasattr(self, "transport"):  # a restart (a fresh manager and engine): a fresh adapter with them
            self.transport = AdapterTransport(self.m, self.engine)
            self.engine.deliver = self.transport.deliver

    @rule(numpy_sequence=st.booleans(), refuse=st.sampled_from([None, *REFUSALS]))
    def scheduler_output_shape(self, numpy_sequence: bool, refuse: str | None) -> None:
        """How the next scheduler outputs look: a numpy sequence; a malformed one first (refused, retried)."""
        self.transport.numpy_sequence = numpy_sequence
        self.transport.refuse = refuse
        if refuse is not None:
            event(f"adapter: a malformed scheduler output ({refuse}) is refused, then retried")

    @invariant()
    def adapter_follows_admissions(self) -> None:
        """I12: the adapter holds exactly the admissions the events leave live."""
        if self.m is None:
            return
        assert set(self.transport.adapter.live_req_ids) == set(self.engine.admitted), (
            sorted(self.transport.adapter.live_req_ids), sorted(self.engine.admitted))

    def teardown(self) -> None:
        if self.m is not None and self.ok and self.transport.same_step_controls:
            event("adapter: a control arrived with its owner's first new request")
        super().teardown()


class AsyncAdapterMachine(AdapterMachine):
    MODE = "async"


TestAdapterEager = AdapterMachine.TestCase
TestAdapterEager.settings = base._scaled(3, 2)
TestAdapterAsync = AsyncAdapterMachine.TestCase
TestAdapterAsync.settings = base._scaled(2, 2)
