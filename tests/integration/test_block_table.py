"""BlockTableView: CPU slots of a step from a vLLM-style input batch.

Checks slot = table[i, p // block_size] * block_size + p % block_size against a
scalar reference over random batches (both the Python path of small steps and the
vectorized one of large steps), kernel-block tables (a manager block split
into kernel blocks gives the manager's slots; any other split or size is refused,
I5's input), positions past the row's
blocks, device tensors refused (no sync), and that the view is a snapshot of the
persistent batch (I4's input).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cache_helpers import slot_of
from fakes_vllm import InputBatch

from omni_cache import PrefixCacheSchedulerAdapter, PrefixCacheWriteLayout
from omni_cache.integration import BlockTableView, block_table


def _batch(rows, *, block_size=4, max_blocks=8) -> InputBatch:
    batch = InputBatch(max_num_reqs=8, max_num_blocks_per_req=max_blocks, block_size=block_size)
    for req_id, computed, blocks in rows:
        batch.add_request(req_id, computed, blocks)
    return batch


@pytest.fixture(params=["python", "vectorized"])
def slot_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a step's slots are computed: in Python (small steps) and vectorized (large)."""
    monkeypatch.setattr(block_table, "_SMALL_STEP_TOKENS", 1 << 30 if request.param == "python" else 0)
    return request.param


def test_slots_match_the_scalar_formula_on_random_batches(slot_path: str) -> None:
    rng = random.Random(7)
    for _ in range(30):
        bs = rng.choice([1, 2, 4, 16])
        rows = []
        for i in range(rng.randint(1, 6)):
            blocks = rng.sample(range(1, 200), rng.randint(1, 6))
            rows.append((f"r{i}", rng.randint(0, len(blocks) * bs - 1), blocks))
        view = BlockTableView.from_input_batch(_batch(rows, block_size=bs), block_size=bs)
        spans, expected = [], []
        for req_id, computed, blocks in rows:
            end = rng.randint(computed, len(blocks) * bs)
            spans.append((req_id, computed, end))
            expected += [slot_of(blocks, p, bs) for p in range(computed, end)]
        assert view.slots_for_spans(spans).tolist() == expected
        counts = [end - start for _, start, end in spans]
        assert view.slots_for_counts(counts).tolist() == expected  # the spans start at num_computed_tokens


def test_from_input_batch_reads_order_and_computed_tokens() -> None:
    batch = _batch([("a", 3, [5]), ("b", 0, [6]), ("c", 8, [1, 2, 3])])
    batch.remove_request("a")
    batch.condense()  # vLLM moves the tail row into the hole: order becomes c, b
    view = BlockTableView.from_input_batch(batch, block_size=4)
    assert view.req_ids == ("c", "b")
    assert view.num_computed_tokens == (8, 0)
    assert view.slots_for_spans([("c", 8, 10)]).tolist() == [12, 13]


def test_a_table_block_size_that_does_not_divide_the_caches_is_refused() -> None:
    batch = _batch([("a", 0, [1])], block_size=24)
    with pytest.raises(ValueError, match=r"block size mismatch.*32-token blocks but this block table uses 24"):
        BlockTableView.from_input_batch(batch, block_size=32)


def test_a_kernel_block_table_gives_the_managers_slots() -> None:
    """Manager blocks of 32 split into kernel blocks of 8: block b is kernel blocks 4b .. 4b+3."""
    manager_blocks = [5, 2, 9]
    kernel = [4 * b + j for b in manager_blocks for j in range(4)]
    view = BlockTableView.from_input_batch(_batch([("a", 0, kernel)], block_size=8, max_blocks=16), block_size=32)
    assert view.kernel_blocks_per_block == 4 and view.blocks_of("a") == tuple(manager_blocks)
    expected = [slot_of(manager_blocks, p, 32) for p in range(96)]
    assert view.slots_for_spans([("a", 0, 96)]).tolist() == expected


@pytest.mark.parametrize("kernel", [[8, 9, 10, 12], [9, 10, 11, 12], [8, 9, 10]],
                         ids=["broken-run", "unaligned-run", "partial-block"])
def test_a_kernel_table_that_is_not_the_managers_split_is_refused(kernel) -> None:
    """A packed stride, an unaligned run or half a manager block would give slots the hits never name."""
    batch = _batch([("a", 0, kernel)], block_size=8, max_blocks=16)
    with pytest.raises(ValueError, match=r"request 'a' .* does not hold each 32-token block b as kernel blocks"):
        BlockTableView.from_input_batch(batch, block_size=32)


def test_position_past_the_rows_blocks_raises(slot_path: str) -> None:
    view = BlockTableView.from_input_batch(_batch([("a", 0, [3, 4])]), block_size=4)
    assert view.slots_for_spans([("a", 0, 8)]).tolist() == [12, 13, 14, 15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="position 8 of request 'a' needs block index 2 but its row holds 2"):
        view.slots_for_spans([("a", 6, 9)])


def test_unknown_request_and_bad_spans_raise() -> None:
    view = BlockTableView(["a"], [0], torch.zeros(1, 2, dtype=torch.int32), block_size=4)
    with pytest.raises(ValueError, match="'z' is not in the batch"):
        view.slots_for_spans([("z", 0, 1)])
    with pytest.raises(ValueError, match=r"bad span \[3, 1\)"):
        view.slots_for_spans([("a", 3, 1)])
    assert view.slots_for_spans([]).tolist() == []


def test_malformed_inputs_raise() -> None:
    with pytest.raises(ValueError, match="duplicate request ids"):
        BlockTableView(["a", "a"], [0, 0], torch.zeros(2, 1), block_size=4)
    with pytest.raises(ValueError, match="1 num_computed_tokens for a batch of 2"):
        BlockTableView(["a", "b"], [0], torch.zeros(2, 1), block_size=4)
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        BlockTableView(["a", "b"], [0, 0], torch.zeros(1, 1), block_size=4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockTableView(["a"], [0], torch.zeros(1, 1), block_size=0)


def test_device_tensors_are_refused_without_reading_them() -> None:
    meta = torch.zeros(1, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="block_table_cpu must be a CPU tensor, the engine's CPU mirror"):
        BlockTableView(["a"], [0], meta, block_size=4)
    with pytest.raises(ValueError, match="num_computed_tokens must be a CPU tensor"):
        BlockTableView(["a"], torch.zeros(1, device="meta"), torch.zeros(1, 2), block_size=4)


def test_view_is_a_snapshot_of_the_persistent_batch() -> None:
    batch = _batch([("a", 2, [3, 4])])
    view = BlockTableView.from_input_batch(batch, block_size=4)
    batch.num_computed_tokens_cpu[0] = 0
    batch.block_table[0].get_cpu_tensor().fill_(0)
    assert view.num_computed_tokens == (2,)
    assert view.slots_for_spans([("a", 2, 5)]).tolist() == [14, 15, 16]


def test_empty_rows_inside_the_batch_are_refused() -> None:
    batch = _batch([("a", 0, [1]), ("b", 0, [2])])
    batch.remove_request("a")  # not condensed yet: row 0 is a hole
    with pytest.raises(ValueError, match="empty rows"):
        BlockTableView.from_input_batch(batch, block_size=4)


def test_numpy_and_list_inputs() -> None:
    view = BlockTableView(("a",), np.array([1], dtype=np.int32), [[2, 9]], block_size=2)
    assert view.slots_for_spans([("a", 1, 4)]).tolist() == [5, 18, 19]


# ---- the adapter's view protocols ----------------------------------------------------------
@pytest.mark.parametrize("present", ["req_ids", "slots_for_spans"])
def test_a_view_with_half_of_the_block_table_protocol_is_refused_by_name(present: str) -> None:
    """A block-table view must offer the whole reference protocol: one that has only half of it is refused,
    naming what is missing.

    Kills the mutant: ``adapter:_as_reference_view:boolop_swap:0b3f8f5a`` (either attribute was enough).

    A block-table view must offer the whole reference protocol: one that has only half of it is refused,
    naming what is missing."""
    view = SimpleNamespace(**{present: ["A"] if present == "req_ids" else (lambda spans: torch.empty(0))},
                           num_computed_tokens=[0])
    with pytest.raises(TypeError, match=r"neither a reference group view .* nor a block-table view"):
        PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"A": 4})


def test_a_step_layout_built_through_the_block_table_view_still_works() -> None:
    """The refusal above is of half a protocol only: a whole block-table view is accepted."""
    view = SimpleNamespace(
        req_ids=["A"], num_computed_tokens=[0],
        slots_for_spans=lambda spans: torch.arange(sum(e - s for _, s, e in spans), dtype=torch.int64),
    )
    layout = PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"A": 3})
    assert isinstance(layout, PrefixCacheWriteLayout) and layout.total_rows == 3


def test_counts_and_computed_tokens_of_any_integer_shape_are_read_and_non_integers_refused() -> None:
    """Counts and computed tokens are read flattened from a list, a tuple, a numpy array or a CPU
    tensor of any shape (a scalar for a one-request batch); a count that is not an integer is
    refused by name, never truncated."""
    table = torch.tensor([[3, 5], [7, 9]])
    view = BlockTableView(["a", "b"], np.array([[1], [4]]), table, block_size=4)
    assert view.num_computed_tokens == (1, 4)
    expected = [3 * 4 + 1, 3 * 4 + 2, 9 * 4 + 0]
    for counts in ([2, 1], (2, 1), np.array([[2, 1]]), torch.tensor([2, 1], dtype=torch.int32)):
        assert view.slots_for_counts(counts).tolist() == expected, type(counts)
    one = BlockTableView(["a"], np.int64(2), table, block_size=4)  # a scalar: one request
    assert one.num_computed_tokens == (2,)
    assert one.slots_for_counts(torch.tensor(2)).tolist() == [3 * 4 + 2, 3 * 4 + 3]
    with pytest.raises(ValueError, match=r"token count 2\.0 for 'a' is not an integer"):
        view.slots_for_counts([2.0, 1])
    with pytest.raises(ValueError, match="3 counts for a batch of 2 requests"):
        view.slots_for_counts(np.array([[1, 1, 1]]))
