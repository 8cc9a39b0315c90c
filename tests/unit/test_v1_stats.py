"""engine_v1/stats.py: the V1 engine's scheduler stats as the stub's KvCacheStats (no vLLM needed:
the stats are read by attribute)."""

from __future__ import annotations

from types import SimpleNamespace

from triton_vllm_multistep.engine.events import KvCacheStats
from triton_vllm_multistep.engine_v1.stats import SchedulerStatsLogger


def busy_stats() -> SimpleNamespace:
    prefix = SimpleNamespace(queries=10, hits=4)
    return SimpleNamespace(kv_cache_usage=0.25, num_running_reqs=3, num_waiting_reqs=2, prefix_cache_stats=prefix)


def test_the_newest_stats_give_the_blocks_in_use_the_counts_and_the_hit_rate() -> None:
    recorder = SchedulerStatsLogger()
    recorder.record(busy_stats())
    assert recorder.kv_cache_stats(100) == KvCacheStats(75, 100, 3, 2, prefix_cache_hit_rate=0.4)


def test_an_idle_engine_reports_nothing_held_though_its_newest_stats_were_taken_while_busy() -> None:
    """Aborting the last requests leaves vLLM nothing to step, so no newer stats come: idle is zero."""
    recorder = SchedulerStatsLogger()
    recorder.record(busy_stats())
    assert recorder.kv_cache_stats(100, idle=True) == KvCacheStats(100, 100, 0, 0, prefix_cache_hit_rate=0.4)


def test_before_any_step_the_cache_is_free_and_the_admitted_requests_count_as_running() -> None:
    assert SchedulerStatsLogger().kv_cache_stats(100, running_fallback=2) == KvCacheStats(100, 100, 2, 0)
