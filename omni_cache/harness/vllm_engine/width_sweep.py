"""The cache's cost per step against the forward's, over model widths and dtypes, on real engines.

Owns: ``sweep_config`` (a dummy-weight Llama of a given width, layers and dtype: heads of 128,
a quarter as many KV heads, an MLP twice the width), ``SweepPoint`` (one width and dtype: the
cache's cost and the forward's per step, decode and prefill, from ``step_cost``), ``run_width_sweep``
(one engine per point, built, measured and shut down in turn), ``sweep_rows`` (the table) and
``write_sweep_plot`` (the figure, PNG or SVG).

The forward is measured with ``layers`` layers and reported per layer too, so that a model of
``L`` layers reads its overhead as ``cache / (L x forward per layer)`` (the embedding and final
norm are counted in the layers' share; the cache does not depend on the layers). The cache's
cost is the ``hidden`` stage's (a thinker handing on its hidden rows): ``begin_step + after_forward
+ materialize`` per step, the median over the configuration's steps. vLLM is imported only inside
functions.

Upholds nothing itself (``step_cost`` fails a run that leaves a step id unconsumed).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from omni_cache.harness.figures import save_figure
from omni_cache.harness.vllm_engine.models import BLOCK_SIZE, TINY_LLAMA

__all__ = ["DTYPES", "WIDTHS", "SweepPoint", "run_width_sweep", "sweep_config", "sweep_rows", "write_sweep_plot"]

WIDTHS = (128, 256, 512, 1024, 2048, 4096)
DTYPES = ("float32", "bfloat16")
LAYERS = 2
DECODE_REQUESTS = 8
PREFILL_TOKENS = 256
KV_BLOCKS = 64
_BYTES = {"float32": 4, "bfloat16": 2}


def sweep_config(width: int, layers: int = LAYERS, dtype: str = "float32") -> dict[str, Any]:
    """A Llama ``config.json`` of ``width`` (a multiple of 128): heads of 128, KV heads a quarter of them."""
    if width % 128 or width <= 0:
        raise ValueError(f"width must be a positive multiple of 128, got {width}")
    heads = width // 128
    return {**TINY_LLAMA, "hidden_size": width, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
            "head_dim": 128, "intermediate_size": 2 * width, "num_hidden_layers": layers, "torch_dtype": dtype}


def _kv_bytes_per_block(config: dict[str, Any]) -> int:
    return (config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * config["head_dim"]
            * _BYTES[config["torch_dtype"]])


@dataclass
class SweepPoint:
    width: int
    dtype: str
    layers: int
    decode_requests: int
    prefill_tokens: int
    cache_us_decode: float  # the cache's cost of a decode step of ``decode_requests`` requests
    forward_us_decode: float
    cache_us_prefill: float  # ... of a one-request prefill step of ``prefill_tokens`` tokens
    forward_us_prefill: float
    cache_us_one_token: float  # a one-request, one-token decode step (the fixed cost)

    def fraction(self, kind: str, layers: int | None = None) -> float:
        """The cache's cost over the forward of a model of ``layers`` layers (default: the ones measured)."""
        cache, forward = (self.cache_us_decode, self.forward_us_decode) if kind == "decode" else (
            self.cache_us_prefill, self.forward_us_prefill)
        scale = 1.0 if layers is None else layers / self.layers
        return cache / (forward * scale)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "forward_us_per_layer_decode": round(self.forward_us_decode / self.layers, 2),
                "forward_us_per_layer_prefill": round(self.forward_us_prefill / self.layers, 2),
                "fraction_decode": round(self.fraction("decode"), 5),
                "fraction_prefill": round(self.fraction("prefill"), 5)}


def _measure(width: int, dtype: str, layers: int, repeats: int, progress: Callable[[str], None] | None) -> SweepPoint:
    from omni_cache.harness.vllm_engine.engine import engine_kwargs, stdout_to_stderr
    from omni_cache.harness.vllm_engine.step_cost import run_step_cost

    config = sweep_config(width, layers, dtype)
    path = tempfile.mkdtemp(prefix=f"omni-cache-sweep-{width}-{dtype}-")
    llm = None
    try:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        from vllm import LLM

        with stdout_to_stderr():
            llm = LLM(**engine_kwargs(path, kv_blocks=KV_BLOCKS, max_batched_tokens=1024, max_model_len=1024,
                                      dtype=dtype, kv_cache_memory_bytes=KV_BLOCKS * _kv_bytes_per_block(config)))
        result = run_step_cost(llm, model=f"llama w{width} {dtype}", repeats=repeats, decode_steps=12,
                               decode_batches=(1, DECODE_REQUESTS), prefill_tokens=(PREFILL_TOKENS,),
                               stages=("hidden",), progress=progress)
        if result.unconsumed:
            raise RuntimeError(f"width sweep: {result.unconsumed} step ids left unconsumed at width {width}")
        by = {(c.kind, c.requests, c.rows): c for c in result.configs}
        dec, pre = by[("decode", DECODE_REQUESTS, DECODE_REQUESTS)], by[("prefill", 1, PREFILL_TOKENS)]
        return SweepPoint(width, dtype, layers, DECODE_REQUESTS, PREFILL_TOKENS, dec.cache_us, dec.forward_us,
                          pre.cache_us, pre.forward_us, result.one_token("hidden").cache_us)
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
        gc.collect()
        shutil.rmtree(path, ignore_errors=True)


def run_width_sweep(widths: Sequence[int] = WIDTHS, dtypes: Sequence[str] = DTYPES, *, layers: int = LAYERS,
                    repeats: int = 2, progress: Callable[[str], None] | None = None) -> list[SweepPoint]:
    """One engine per (dtype, width), measured by ``step_cost`` and shut down before the next."""
    from omni_cache.harness.vllm_engine.engine import prepare_vllm_env

    prepare_vllm_env()
    points = []
    for dtype in dtypes:
        for width in widths:
            if progress is not None:
                progress(f"width {width} {dtype}: building the engine")
            points.append(_measure(width, dtype, layers, repeats, progress))
    return points


def sweep_rows(points: list[SweepPoint], model_layers: Sequence[int] = (28, 48)) -> list[dict[str, str]]:
    """The table: per point, the cache's and the forward's µs per step and the cache's share for the
    layers measured and for models of ``model_layers`` layers."""
    rows = []
    for p in points:
        row = {"width": str(p.width), "dtype": p.dtype, "fixed µs": f"{p.cache_us_one_token:.0f}",
               f"cache µs decode {p.decode_requests}": f"{p.cache_us_decode:.0f}",
               "fwd µs/layer decode": f"{p.forward_us_decode / p.layers:,.0f}",
               f"cache µs prefill {p.prefill_tokens}": f"{p.cache_us_prefill:.0f}",
               "fwd µs/layer prefill": f"{p.forward_us_prefill / p.layers:,.0f}"}
        for n in model_layers:
            row[f"{n} layers: decode / prefill"] = (f"{100 * p.fraction('decode', n):.2f}% / "
                                                    f"{100 * p.fraction('prefill', n):.2f}%")
        rows.append(row)
    return rows


def write_sweep_plot(points: list[SweepPoint], path: str, *, title: str, footnote: str,
                     model_layers: int = 28) -> str:
    """Two panels over width (log scale), one line per dtype: µs per step (the cache; the forward of one
    layer) and the cache's share of a ``model_layers``-layer model's forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for dtype, style in zip(DTYPES, ("-", "--"), strict=False):
        pts = sorted((p for p in points if p.dtype == dtype), key=lambda p: p.width)
        if not pts:
            continue
        w = [p.width for p in pts]
        ax1.plot(w, [p.cache_us_decode for p in pts], "o" + style, color="tab:red", label=f"cache, decode ({dtype})")
        ax1.plot(w, [p.forward_us_decode / p.layers for p in pts], "s" + style, color="tab:blue",
                 label=f"forward per layer, decode ({dtype})")
        ax1.plot(w, [p.cache_us_prefill for p in pts], "^" + style, color="tab:orange",
                 label=f"cache, prefill ({dtype})")
        ax1.plot(w, [p.forward_us_prefill / p.layers for p in pts], "v" + style, color="tab:cyan",
                 label=f"forward per layer, prefill ({dtype})")
        ax2.plot(w, [100 * p.fraction("decode", model_layers) for p in pts], "o" + style, color="tab:red",
                 label=f"decode {pts[0].decode_requests} requests ({dtype})")
        ax2.plot(w, [100 * p.fraction("prefill", model_layers) for p in pts], "^" + style, color="tab:orange",
                 label=f"prefill {pts[0].prefill_tokens} tokens ({dtype})")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden width")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("µs per step")
    ax1.set_title("the cache's cost vs one layer's forward")
    ax1.legend(fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel(f"cache / forward of a {model_layers}-layer model (%)")
    ax2.axhline(2.0, color="gray", linestyle=":", label="2%")
    ax2.set_title(f"the cache's share of a {model_layers}-layer forward")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, footnote, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return str(save_figure(fig, path))
