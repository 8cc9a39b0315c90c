"""Prometheus metrics on Triton's metrics endpoint, through pb_utils.MetricFamily.

Owns metric names, labels and updates; must not decide anything from them.
"""

from __future__ import annotations

from typing import Any

from .engine_loop import KvCacheStats


class BackendMetrics:
    """Gauges of the engine's state, labelled with model and version like Triton's vLLM backend."""

    def __init__(self, pb_utils: Any, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        gauge = pb_utils.MetricFamily.GAUGE
        # A Metric is only valid while its MetricFamily object lives: keep the families.
        self._families: list[Any] = []

        def make(name: str, description: str) -> Any:
            family = pb_utils.MetricFamily(name=name, description=description, kind=gauge)
            self._families.append(family)
            return family.Metric(labels=labels)

        self._running = make("vllm:num_requests_running", "Requests in the engine's running batch")
        self._waiting = make("vllm:num_requests_waiting", "Requests waiting (or swapped out) in the engine")
        self._usage = make("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (CPU memory on CPU hosts)")
        self._free = make("vllm_multistep:kv_cache_free_blocks", "Free KV-cache blocks")
        self._total = make("vllm_multistep:kv_cache_total_blocks", "All KV-cache blocks")

    def update_engine_state(self, stats: KvCacheStats) -> None:
        self._running.set(stats.running)
        self._waiting.set(stats.waiting)
        self._free.set(stats.free_blocks)
        self._total.set(stats.total_blocks)
        used = stats.total_blocks - stats.free_blocks
        self._usage.set(used / stats.total_blocks if stats.total_blocks else 0.0)
