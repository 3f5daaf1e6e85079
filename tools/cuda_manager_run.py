"""A short run of the manager's CUDA path, small enough for compute-sanitizer.

    python3 tools/cuda_manager_run.py                 # on a CUDA device (exit 2 without one)
    python3 tools/cuda_manager_run.py --device cpu    # the same run on the CPU (a dry run)

tools/device_check.sh runs it under compute-sanitizer's memcheck, racecheck and synccheck. One
manager with ``eager=False`` (the committer thread; with CUDA: pinned pages, copies on the side
stream ordered by events), hidden rows and an immediate mm key saved from the device, a
deferred mm key held on the device under a ``gpu_staging_bytes`` budget so small that every
full prompt's step forces a flush, prefix hits on blocks an earlier request computed, blocks reused by new
tenants, and a builder thread that materializes each step one step late. Every materialized
row is compared with the ground truth (rows are a function of the family's or the request's
tag and the position), then ``shutdown`` must report no unconsumed step and no failed write.
Prints one line: what ran and "ok", exit 0; a mismatch or contract error, exit 1.

Invariants: checks I1 (each step id consumed once), I4/I6/I7 (the rows served), I9 (nothing
left in flight at shutdown) from outside; upholds none.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
from pathlib import Path

BS = 4  # tokens per KV block
PROMPT = 16  # a family's prompt: 4 blocks
HIT = 8  # a follower's hit: the family's first 2 blocks
WIDTH = 16
NUM_BLOCKS = 24


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cuda_manager_run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=40, help="engine steps (default 40)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.steps < 1:
        print("cuda_manager_run: error: --steps must be >= 1", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"cuda_manager_run: no CUDA device: torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    from omni_cache import (
        ModelCachePolicy,
        OmniPrefixCacheManager,
        PrefixCacheConfig,
        PrefixCacheEventKind,
        PrefixCacheRequestEvent,
        PrefixCacheWriteLayout,
    )

    dev = torch.device(args.device)

    def truth(tag: str, start: int, end: int) -> dict[str, torch.Tensor]:
        """Exact rows of ``tag`` at positions [start, end) (host tensors)."""
        base = (sum(ord(c) * 31**i for i, c in enumerate(tag)) % 997) + 1
        pos = torch.arange(start, end, dtype=torch.float32)[:, None]
        hidden = base * 1000.0 + pos * 10.0 + torch.arange(WIDTH, dtype=torch.float32)[None, :]
        return {"hidden": hidden, "audio.codes": (hidden[:, :2] * -1).to(torch.int64),
                "audio.embeds": hidden[:, :3] / 4}

    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_depth=3, staging_capacity_tokens=32,
                               gpu_staging_bytes=128, staging_claim_timeout_s=30.0)
    m = OmniPrefixCacheManager(config, eager=False)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio.embeds"})))
    jobs: queue.Queue[tuple[int, str, dict[str, torch.Tensor]] | None] = queue.Queue()
    errors: list[str] = []
    checked = [0]

    def builder() -> None:
        while (job := jobs.get()) is not None:
            step_id, rid, want = job
            try:
                out = m.materialize(step_id, [rid])
                got = {"hidden": out.hidden_states[rid], **out.mm_for(rid)}  # type: ignore[index]
                for key, rows in want.items():
                    if got[key].device.type != "cpu" or not torch.equal(got[key], rows):
                        errors.append(f"step {step_id} {rid} key {key}: served rows differ from the truth")
                checked[0] += want["hidden"].shape[0]
            except Exception as exc:
                errors.append(f"step {step_id} {rid}: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=builder, name="builder", daemon=True)
    thread.start()
    free = list(range(NUM_BLOCKS))
    owner: dict[int, str] = {}  # block -> the family whose prompt rows it holds
    families: dict[str, list[int]] = {}  # family -> its prompt's blocks (while all still hold its rows)
    running: list[tuple[str, list[int]]] = []  # requests to finish at the next step
    hits = 0
    for k in range(args.steps):
        events = [PrefixCacheRequestEvent(r, PrefixCacheEventKind.FINISHED) for r, _ in running]
        for _, blocks in running:
            free.extend(b for b in blocks if b not in free)
        running = []
        family = f"f{k % 3}"
        rid = f"r{k}"
        intact = families.get(family)
        if intact is not None and all(owner.get(b) == family for b in intact):
            shared = intact[: HIT // BS]
            for b in shared:
                if b in free:
                    free.remove(b)
            mine = [free.pop(0) for _ in range((PROMPT - HIT) // BS)]
            blocks, start = shared + mine, HIT
            for b in mine:  # new tenants of these blocks
                owner.pop(b, None)
            want = {key: torch.cat([truth(family, 0, HIT)[key], truth(rid, HIT, PROMPT)[key]])
                    for key in ("hidden", "audio.codes", "audio.embeds")}
            rows = truth(rid, HIT, PROMPT)
            hits += 1
        else:
            blocks = [free.pop(0) for _ in range(PROMPT // BS)]
            for b in blocks:
                owner[b] = family
            families[family] = blocks
            start, rows = 0, truth(family, 0, PROMPT)
            want = rows
        for fam, fam_blocks in list(families.items()):  # a family whose block got a new tenant is gone
            if any(owner.get(b) != fam for b in fam_blocks):
                del families[fam]
        events.append(PrefixCacheRequestEvent(rid, PrefixCacheEventKind.STARTED, 0, start,
                                              (tuple(blocks),) if start else (), PROMPT - start))
        m.new_step_starts(events)
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, PROMPT)], dtype=torch.int64)
        n = PROMPT - start
        live = {key: value.to(dev, copy=True) for key, value in rows.items()}  # the forward's outputs
        step_id = m.save_outputs(live["hidden"], {"audio.codes": live["audio.codes"],
                                                  "audio.embeds": live["audio.embeds"]},
                                 num_tokens_unpadded=n, num_tokens_padded=n,
                                 write_layout=PrefixCacheWriteLayout.packed([(rid, start, PROMPT)], slots))
        for value in live.values():
            value.fill_(-1)  # the next forward reuses the buffers at once (I4)
        jobs.put((step_id, rid, want))
        running.append((rid, blocks))
    m.new_step_starts([PrefixCacheRequestEvent(r, PrefixCacheEventKind.FINISHED) for r, _ in running])
    jobs.put(None)
    thread.join(60)
    unconsumed = m.shutdown()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    stats = m.stats()
    if thread.is_alive():
        errors.append("the builder thread did not finish within 60 s")
    if unconsumed:
        errors.append(f"unconsumed step ids at shutdown: {sorted(unconsumed)}")
    if stats["failed"] is not None or stats["writes_in_flight"]:
        errors.append(f"failed {stats['failed']}, writes in flight {stats['writes_in_flight']}")
    if hits == 0 or stats["budget_flushes"] == 0:
        errors.append(f"the run did not reach what it is for: {hits} hits, {stats['budget_flushes']} budget flushes")
    what = (f"{args.steps} steps on {dev.type} (eager=False, use_cuda={m.use_cuda}), {hits} hits, "
            f"{checked[0]} rows checked, {stats['budget_flushes']} deferred-budget flushes")
    if errors:
        print(f"cuda_manager_run: FAILED: {what}; " + "; ".join(errors[:5]), file=sys.stderr)
        return 1
    print(f"cuda_manager_run: ok: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
