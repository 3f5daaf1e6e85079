"""Which worker rank of a parallel engine stage holds the cache, and what it costs there.

Owns: ``WorkerRank`` (one worker's place in the tensor- and pipeline-parallel
grid, and whether it holds the cache), ``vllm_worker_rank()`` (the calling
worker's place, read from vLLM's parallel groups lazily), ``output_rank_index``
(vLLM's ``_get_output_rank``: TP rank 0 of the last pipeline stage),
``data_parallel_replica`` (which data-parallel replica a worker serves), ``cache_bytes`` (the
host bytes a manager holds) and ``prepare_parallel_env`` /
``thread_binding`` (the environment a multi-process CPU engine needs; reusable
by every command that starts one).

Why the output rank only: vLLM takes the step's ``ModelRunnerOutput`` from one
worker, TP rank 0 of the last pipeline stage. The hidden states after the last
all-reduce are the same on every TP rank of that stage, so a cache on each of
them would hold the same rows ``tp_size`` times; non-last stages have no
hidden states of the model's last layer at all. Every other rank's hooks are
no-ops that allocate nothing. ``all_tp_ranks=True`` (``--check-ranks``) keeps a
cache on every TP rank of the last stage so that their agreement is checked,
not assumed. Upholds I5 (the gate decides per rank, before any step); the
rest is the manager's.
"""

from __future__ import annotations

import operator
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["WorkerRank", "cache_bytes", "data_parallel_replica", "output_rank_index", "prepare_parallel_env", "thread_binding",
           "vllm_worker_rank"]


@dataclass(frozen=True)
class WorkerRank:
    """One worker's coordinates; the single-process engine is ``WorkerRank()``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"WorkerRank: sizes must be >= 1 (tp_size={self.tp_size}, pp_size={self.pp_size})")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"WorkerRank: tp_rank {self.tp_rank} / pp_rank {self.pp_rank} outside tp_size "
                             f"{self.tp_size} / pp_size {self.pp_size}")

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """TP rank 0 of the last pipeline stage: the rank whose output vLLM returns."""
        return self.is_last_pp_stage and self.tp_rank == 0

    @property
    def rank(self) -> int:
        """The global rank in vLLM's ordering (PP-major, then TP)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def holds_cache(self, *, all_tp_ranks: bool = False) -> bool:
        """The output rank; with ``all_tp_ranks``, every TP rank of the last stage."""
        return self.is_output_rank or (all_tp_ranks and self.is_last_pp_stage)

    def as_dict(self) -> dict[str, int | bool]:
        return {**asdict(self), "rank": self.rank, "output_rank": self.is_output_rank}


def output_rank_index(tp_size: int, pp_size: int) -> int:
    """The global rank vLLM returns outputs from (its ``_get_output_rank``)."""
    return WorkerRank(0, tp_size, pp_size - 1, pp_size).rank


def vllm_worker_rank() -> WorkerRank:
    """The calling worker's place, from vLLM's TP and PP groups; ``WorkerRank()``
    when vLLM is not installed or its distributed state is not initialized."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    except ImportError:
        return WorkerRank()
    try:
        tp, pp = get_tp_group(), get_pp_group()
    except AssertionError:  # groups not initialized: a single process
        return WorkerRank()
    return WorkerRank(int(tp.rank_in_group), int(tp.world_size), int(pp.rank_in_group), int(pp.world_size))


def cache_bytes(manager: Any) -> dict[str, int]:
    """Host bytes a manager holds: the prefix pool and the staging pages (host
    memory on every device: pinned on CUDA); zeros for ``None`` (no cache)."""
    if manager is None:
        return {"pool_bytes": 0, "staging_bytes": 0, "host_bytes": 0}
    pool = sum(int(n) for n in manager.pool.nbytes().values())
    staging = sum(int(n) for n in manager.staging.page_bytes().values())
    return {"pool_bytes": pool, "staging_bytes": staging, "host_bytes": pool + staging}


def thread_binding(world_size: int, cpus: list[int] | None = None) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``world_size`` local
    workers its own CPUs (contiguous shares of this process's affinity; with
    fewer CPUs than workers, workers share CPUs round-robin)."""
    if world_size < 1:
        raise ValueError(f"thread_binding: world_size must be >= 1, got {world_size}")
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if not cpus:
        raise ValueError("thread_binding: no CPUs to bind")
    if len(cpus) < world_size:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(world_size))
    share, extra = divmod(len(cpus), world_size)
    parts, start = [], 0
    for i in range(world_size):
        n = share + (1 if i < extra else 0)
        parts.append(",".join(str(c) for c in cpus[start:start + n]))
        start += n
    return "|".join(parts)


def prepare_parallel_env(world_size: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set what a multi-process vLLM CPU engine of ``world_size`` workers needs
    and return the variables it set (none for one worker):

    - ``VLLM_CPU_OMP_THREADS_BIND`` (unless the user set it): vLLM's ``auto``
      binding gives each worker a NUMA node and refuses more workers than nodes;
    - ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` (vLLM's CPU platform forces it
      anyway): workers re-import the parent's main module, so the program that
      builds the engine must guard its entry point with
      ``if __name__ == "__main__":`` (the ``omni-cache`` console script and
      ``python -m omni_cache.cli`` do).
    """
    env = os.environ if environ is None else environ
    if world_size <= 1:
        return {}
    wanted = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(world_size)
    env.update(wanted)
    return wanted


def data_parallel_replica(parallel_config: Any) -> int:
    """The data-parallel replica (0 .. data_parallel_size - 1) whose engine core holds ``parallel_config``
    (vLLM's ``ParallelConfig``; 0 without one).

    NOTE: vLLM runs each replica of a dense model as an independent engine: its engine core resets
    ``data_parallel_rank`` to 0 (and the size to 1) and keeps the replica's own rank in
    ``data_parallel_index``; a MoE model's replicas keep both. So the index is read first."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value: Any = getattr(parallel_config, name, None)
        if value is None or isinstance(value, bool):
            continue
        try:
            replica = operator.index(value)  # an int or a numpy integer; never a float or a string
        except TypeError:
            continue
        if replica >= 0:
            return replica
    return 0
