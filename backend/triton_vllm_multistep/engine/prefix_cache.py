"""Prefix-cache figures read from vLLM's V0 schedulers (the hit rate vLLM's own stats report).

Owns reading them; must not change the cache or the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.utils import Device


def prefix_cache_hit_rate(schedulers: Sequence[Any]) -> float:
    """The device KV cache's block hit rate since start (mean over schedulers); -1 with caching off.

    vLLM's block manager answers -1 when prefix caching is off; the device blocks are the KV cache
    whatever the platform (CPU memory on CPU hosts; vLLM's Device.CPU is swap space).
    """
    rates = [s.get_prefix_cache_hit_rate(Device.GPU) for s in schedulers]
    rates = [r for r in rates if r >= 0]
    return sum(rates) / len(rates) if rates else -1.0
