"""The V1 engine's scheduler statistics, kept as they arrive, read as engine/events.KvCacheStats.

Owns the stat logger the V1 engine is built with (vLLM calls it after each step with its
SchedulerStats: running and waiting requests, the KV cache's usage, prefix-cache queries and hits;
and its IterationStats: tokens through the model, preemptions) and turning them into what the
stub's metrics publish (KvCacheStats; a step's iteration tokens and preemptions).
"""

from __future__ import annotations

import threading
from typing import Any

from triton_vllm_multistep.engine.events import KvCacheStats


class SchedulerStatsLogger:
    """Holds the newest SchedulerStats and the prefix cache's totals since start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: Any = None
        self._queries = 0
        self._hits = 0
        self._iteration_tokens: int | None = None
        self._preemptions = 0

    @classmethod
    def factory(cls) -> Any:
        """A StatLoggerFactory (vllm_config, engine_index → StatLoggerBase) whose logger records into
        one SchedulerStatsLogger, reachable as the factory's `latest`."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        latest = cls()

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    latest.record(scheduler_stats)
                if iteration_stats is not None:
                    latest.record_iteration(iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        Recorder.latest = latest  # type: ignore[attr-defined]
        return Recorder

    def record(self, scheduler_stats: Any) -> None:
        with self._lock:
            self._stats = scheduler_stats
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                self._queries += int(getattr(prefix, "queries", 0))
                self._hits += int(getattr(prefix, "hits", 0))

    def record_iteration(self, iteration_stats: Any) -> None:
        """One step's IterationStats, as vLLM 0.32's Prometheus logger reads them: the tokens through the
        model (prompt tokens computed, not those from the cache, plus those generated) and the
        requests preempted. Called in the engine thread's `step()`."""
        prompt = getattr(iteration_stats, "prompt_token_stats", None)
        computed = prompt.computed if prompt is not None else iteration_stats.num_prompt_tokens
        with self._lock:
            self._iteration_tokens = (self._iteration_tokens or 0) + computed + iteration_stats.num_generation_tokens
            self._preemptions += iteration_stats.num_preempted_reqs

    def take_iteration(self) -> tuple[int | None, int]:
        """The iteration tokens and preemptions recorded since the last call (None: no step recorded)."""
        with self._lock:
            taken = self._iteration_tokens, self._preemptions
            self._iteration_tokens, self._preemptions = None, 0
        return taken

    def kv_cache_stats(self, total_blocks: int, running_fallback: int = 0, idle: bool = False) -> KvCacheStats:
        """The newest stats as KvCacheStats. `idle`: the engine holds no request. vLLM records stats
        only after a step, and aborting the last requests leaves nothing to step: the newest stats
        would show their blocks and their count forever. Idle, no block is held (vLLM's usage counts
        cached but unreferenced blocks as free), so the figures are zero."""
        with self._lock:
            stats, queries, hits = self._stats, self._queries, self._hits
        hit_rate = hits / queries if queries else -1.0
        if idle:
            return KvCacheStats(total_blocks, total_blocks, 0, 0, prefix_cache_hit_rate=hit_rate)
        if stats is None:
            return KvCacheStats(total_blocks, total_blocks, running_fallback, 0)
        usage = float(getattr(stats, "kv_cache_usage", getattr(stats, "gpu_cache_usage", 0.0)))
        used = round(usage * total_blocks)
        return KvCacheStats(
            free_blocks=total_blocks - used,
            total_blocks=total_blocks,
            running=int(stats.num_running_reqs),
            waiting=int(stats.num_waiting_reqs),
            prefix_cache_hit_rate=hit_rate,
        )
