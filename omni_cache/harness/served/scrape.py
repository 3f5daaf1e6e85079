"""A served engine's ``/metrics``, read as a client reads it: over HTTP, parsed by prometheus_client.

Owns: ``scrape_metrics`` (GET ``/metrics``, parsed with prometheus_client's own text parser into
``{sample: value}``, summed over vLLM's ``engine`` label and without ``model_name``, so a key
reads ``vllm:omni_cache_saved_tokens_total`` or ``vllm:omni_cache_errors_total{kind="staging"}``;
histogram buckets and ``_created`` samples are left out) and ``MetricsScrape`` (what came back:
the samples, or why there are none). Used by ``check-server`` and the served tests.

Upholds: a missing endpoint, a server without the cache's series or a text the parser refuses
is reported as such (``available`` false with a ``note``), never as zeros.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omni_cache.integration.metrics import PREFIX

__all__ = ["VLLM_PREFIX_SAMPLES", "MetricsScrape", "metrics_section", "scrape_metrics", "scrape_settled"]

# vLLM's own prefix-cache series (local and through a KV connector), read beside the cache's.
VLLM_PREFIX_SAMPLES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                       "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")
_DROP_LABELS = ("engine", "model_name")


@dataclass
class MetricsScrape:
    """The cache's samples on ``/metrics`` (and vLLM's prefix-cache ones), or a note saying why none."""

    url: str
    samples: dict[str, float] = field(default_factory=dict)
    note: str | None = None

    @property
    def available(self) -> bool:
        return self.note is None

    def delta(self, before: MetricsScrape) -> dict[str, float]:
        """Each sample's change since ``before`` (counters and histogram counts/sums: what happened
        in between; gauges: how they moved)."""
        return {k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()}


def _key(name: str, labels: dict[str, str]) -> str:
    rest = sorted((k, v) for k, v in labels.items() if k not in _DROP_LABELS)
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in rest) + "}" if rest else "")


def parse_samples(text: str, prefixes: Iterable[str] = (PREFIX,)) -> dict[str, float]:
    """The samples of ``text`` whose names start with one of ``prefixes`` or are vLLM's prefix-cache
    counters, summed over engines; buckets and ``_created`` samples left out."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = tuple(prefixes)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            if not (sample.name.startswith(wanted) or sample.name in VLLM_PREFIX_SAMPLES):
                continue
            key = _key(sample.name, dict(sample.labels))
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def scrape_metrics(base_url: str, timeout_s: float = 30.0) -> MetricsScrape:
    """GET ``base_url/metrics`` and parse it (see the module docstring)."""
    url = base_url.rstrip("/") + "/metrics"
    scrape = MetricsScrape(url)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        scrape.note = f"GET {url}: HTTP {exc.code}"
        return scrape
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        scrape.note = f"GET {url}: {exc}"
        return scrape
    try:
        scrape.samples = parse_samples(text)
    except ImportError:
        scrape.note = "prometheus_client is not installed: /metrics was not parsed"
        return scrape
    except ValueError as exc:
        scrape.note = f"{url} is not Prometheus text: {exc}"
        return scrape
    if not any(k.startswith(PREFIX) for k in scrape.samples):
        scrape.note = (f"{url} has no {PREFIX}* series (a server without OmniKVConnector in its "
                       "--kv-transfer-config, or one whose cache metrics are off)")
    return scrape


def scrape_settled(base_url: str, timeout_s: float = 30.0, settle_s: float = 5.0) -> MetricsScrape:
    """``scrape_metrics`` until two scrapes half a second apart agree (the engine's last steps'
    stats reach the API server a moment after their outputs), at most ``settle_s``."""
    deadline = time.monotonic() + settle_s
    scrape = scrape_metrics(base_url, timeout_s)
    while scrape.available and time.monotonic() < deadline:
        time.sleep(0.5)
        again = scrape_metrics(base_url, timeout_s)
        if again.samples == scrape.samples or not again.available:
            return again
        scrape = again
    return scrape


def metrics_section(before: MetricsScrape, after: MetricsScrape) -> dict[str, Any]:
    """A report's metrics part: the totals after a run and their change during it, or the note."""
    if not before.available or not after.available:
        return {"available": False, "url": after.url, "note": after.note or before.note}
    return {"available": True, "url": after.url, "total": dict(after.samples), "change": after.delta(before)}
