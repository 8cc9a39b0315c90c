"""vLLM V0 prefix caching as this backend runs it: the hit-rate figure, and the fix for vLLM 0.8.5's
stale cached-token count that gave preempted requests wrong tokens.

Owns reading the figures vLLM's stats report and the one correction to vLLM's scheduler below;
must not otherwise change the cache or the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.sequence import SequenceStatus
from vllm.utils import Device


def prefix_cache_hit_rate(schedulers: Sequence[Any]) -> float:
    """The device KV cache's block hit rate since start (mean over schedulers); -1 with caching off.

    vLLM's block manager answers -1 when prefix caching is off; the device blocks are the KV cache
    whatever the platform (CPU memory on CPU hosts; vLLM's Device.CPU is swap space).
    """
    rates = [s.get_prefix_cache_hit_rate(Device.GPU) for s in schedulers]
    rates = [r for r in rates if r >= 0]
    return sum(rates) / len(rates) if rates else -1.0


def count_cached_tokens_afresh(scheduler: Any) -> bool:
    """Make every prefill pass of `scheduler` count a waiting request's cached tokens anew.

    vLLM 0.8.5's ComputedBlocksTracker keeps the cached-token count it first found for a sequence
    in prefill. A waiting request that cannot be scheduled yet (not enough free blocks, the batch
    budget) keeps that count while other requests evict the cached blocks behind it; when it is
    scheduled at last, blocks allocated fresh are still reported as computed, the model runner
    skips their prefill, and attention reads another sequence's K/V (preempted requests, which come
    back through the waiting queue when blocks are short, continued with wrong tokens). vLLM fixed
    it after 0.8.5 (vllm-project/vllm#18957) by forgetting the count whenever a request is left
    unscheduled; forgetting the counts of everything still waiting before each prefill pass is
    equivalent. Waiting sequences hold no blocks, so nothing else is tracked for them; swapped
    ones are decoding, whose count vLLM recomputes every time. Returns whether it was installed
    (prefix caching on).
    """
    block_manager = scheduler.block_manager
    tracker = getattr(block_manager, "_computed_blocks_tracker", None)
    if not scheduler.cache_config.enable_prefix_caching or tracker is None:
        return False
    schedule_prefills: Callable[..., Any] = scheduler._schedule_prefills

    def schedule_prefills_with_fresh_counts(*args: Any, **kwargs: Any) -> Any:
        for seq_group in scheduler.waiting:
            for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
                tracker._seq_id_to_num_tokens_computed.pop(seq.seq_id, None)
        return schedule_prefills(*args, **kwargs)

    scheduler._schedule_prefills = schedule_prefills_with_fresh_counts
    return True


def count_cached_prompt_tokens_on_cpu(model_runner: Any) -> bool:
    """Make vLLM's CPU model runner record each prefill's prefix-cache hit in the sequence's data,
    as its GPU model runner does (vllm/worker/model_runner.py: `update_num_cached_tokens(
    len(computed_block_nums) * block_size)` for a prompt with computed blocks): vLLM 0.8.5's CPU input
    builder skips the cached blocks' prefill but never records them, so every RequestOutput's
    `num_cached_tokens` (return_perf_metrics) read 0 on CPU. Returns whether it was installed (a
    runner with vLLM's CPU input builder)."""
    builder = getattr(model_runner, "builder", None)
    compute = getattr(builder, "_compute_prompt_input_tokens", None)
    if compute is None:
        return False
    block_size = model_runner.block_size

    def compute_and_count(data: Any, seq_group_metadata: Any, seq_data: Any, seq_id: int) -> Any:
        computed = seq_group_metadata.computed_block_nums
        if computed:
            seq_data.update_num_cached_tokens(len(computed) * block_size)
        return compute(data, seq_group_metadata, seq_data, seq_id)

    builder._compute_prompt_input_tokens = compute_and_count
    return True
