"""Metrics on Triton's metrics endpoint, scraped from the shared real server and checked exactly.

Requests with known prompt lengths (token ids) and fixed output lengths (ignore_eos) make every
counter and histogram count checkable as a delta between two scrapes.
"""

from __future__ import annotations

import asyncio
import time

import tritonclient.grpc.aio as grpcaio
from private_servers import metric, scrape, wait_for, watch_as_a_router
from served_models import LLM_MODEL
from triton_clients import aio_generate

from triton_vllm_multistep.lifecycle.protocol import HEARTBEAT_METRIC, HEARTBEAT_STALE_SECONDS

STREAMED = [(5, 10), (9, 10), (17, 7)]  # (prompt tokens, max_tokens)
WHOLE = [(3, 6), (12, 6)]
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm_multistep:scheduling_windows_total")
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_n",
    # Observed per token or per step: histogram series built from counters.
    "vllm:time_per_output_token_seconds",
    "vllm_multistep:tokens_per_response",
    "vllm_multistep:pythonization_lag_seconds",
    "vllm_multistep:step_host_overhead_seconds",
)
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm_multistep:kv_cache_free_blocks",
    "vllm_multistep:kv_cache_total_blocks",
    "vllm_multistep:engine_alive",
    "vllm_multistep:response_queue_steps",
)


def snapshot(text: str) -> dict[str, float]:
    values = {}
    for name in COUNTERS + GAUGES:
        values[name] = metric(text, name, LLM_MODEL, version="1")
    for name in HISTOGRAMS:
        for suffix in ("_count", "_sum"):
            values[name + suffix] = metric(text, name + suffix, LLM_MODEL, version="1")
    values["tokens_per_response_le_1"] = metric(text, "vllm_multistep:tokens_per_response_bucket", LLM_MODEL, le="1")
    values["e2e_le_inf"] = metric(text, "vllm:e2e_request_latency_seconds_bucket", LLM_MODEL, le="+Inf")
    return values


def idle(text: str) -> bool:
    running = metric(text, "vllm:num_requests_running", LLM_MODEL)
    waiting = metric(text, "vllm:num_requests_waiting", LLM_MODEL)
    return running == 0 and waiting == 0


def prompt_ids(length: int, salt: int) -> list[int]:
    return [1] + [10 + (salt * 7 + i) % 500 for i in range(length - 1)]


def run_requests(url: str) -> list:
    async def run_all():
        async with grpcaio.InferenceServerClient(url) as client:
            jobs = [
                aio_generate(
                    client,
                    LLM_MODEL,
                    input_ids=prompt_ids(n, i),
                    sampling={"temperature": 0, "max_tokens": m, "ignore_eos": True},
                    stream=True,
                )
                for i, (n, m) in enumerate(STREAMED)
            ] + [
                aio_generate(
                    client,
                    LLM_MODEL,
                    input_ids=prompt_ids(n, 50 + i),
                    sampling={"temperature": 0, "max_tokens": m, "ignore_eos": True},
                    stream=False,
                )
                for i, (n, m) in enumerate(WHOLE)
            ]
            return await asyncio.gather(*jobs)

    return asyncio.run(run_all())


def test_metrics_are_exposed_with_triton_vllm_names_kinds_and_labels(server) -> None:
    text = scrape(server)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f"# TYPE {name} counter" in text
    for name in HISTOGRAMS[:5]:
        assert f"# TYPE {name} histogram" in text, name
    for name in GAUGES:
        assert f"# TYPE {name} gauge" in text, name
    # Multi-step histograms are published as histogram series built from counters.
    for name in HISTOGRAMS[5:]:
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"# TYPE {name}{suffix} counter" in text, name + suffix
    assert metric(text, "vllm_multistep:tokens_per_response_bucket", LLM_MODEL, le="+Inf") is not None
    assert metric(text, "vllm_multistep:engine_alive", LLM_MODEL, version="1") == 1
    assert f'vllm:time_to_first_token_seconds_bucket{{model="{LLM_MODEL}",version="1",le="0.001"}}' in text


def test_each_instance_publishes_a_heartbeat_that_keeps_moving(server) -> None:
    """Set every second by the instance's response thread through tritonserver (what the probe reads)."""
    first = metric(scrape(server), HEARTBEAT_METRIC, LLM_MODEL, version="1", instance=f"{LLM_MODEL}_0_0")
    assert first is not None and abs(time.time() - first) <= HEARTBEAT_STALE_SECONDS
    assert wait_for(
        lambda: (metric(scrape(server), HEARTBEAT_METRIC, LLM_MODEL, version="1", instance=f"{LLM_MODEL}_0_0") or 0)
        > first,
        timeout=30,
    ), "the heartbeat did not move"


def quiescent_snapshot(server) -> dict[str, float]:
    """A snapshot once the engine is idle and two scrapes a flush interval apart agree: counts of
    earlier tests' last responses may still be on their way (flushed every 0.25 s)."""
    previous: list[dict[str, float]] = []

    def stable() -> bool:
        text = scrape(server)
        current = snapshot(text)
        same = idle(text) and bool(previous) and previous[-1] == current
        previous.append(current)
        return same

    assert wait_for(stable, timeout=60, interval=0.6), "the metrics never settled"
    return previous[-1]


def test_request_counters_and_histograms_count_exactly_what_was_served(server) -> None:
    before = quiescent_snapshot(server)
    results = run_requests(server.grpc_url)
    for result, (_, max_tokens) in zip(results, STREAMED + WHOLE, strict=True):
        assert result.error is None and result.finals == 1
        assert len(result.token_ids()) == max_tokens
    requests_count = len(STREAMED) + len(WHOLE)
    prompt_total = sum(n for n, _ in STREAMED + WHOLE)
    generated_total = sum(m for _, m in STREAMED + WHOLE)
    streamed_tokens = sum(m for _, m in STREAMED)

    def delta(after: dict, name: str) -> float:
        return after[name] - (before[name] or 0)

    def settled() -> bool:
        after = snapshot(scrape(server))
        return delta(after, "vllm:e2e_request_latency_seconds_count") >= requests_count and idle(scrape(server))

    assert wait_for(settled, timeout=30), "metrics were not flushed"
    # The FINAL flushes the request counts before it is sent; the last step's own series (its
    # pythonization lag) are recorded after its sends and flushed 0.25 s later (a fresh-clone run
    # once read 9 of 10): read once two scrapes agree.
    after = quiescent_snapshot(server)
    assert delta(after, "vllm:prompt_tokens_total") == prompt_total
    assert delta(after, "vllm:generation_tokens_total") == generated_total
    assert delta(after, "vllm:request_prompt_tokens_count") == requests_count
    assert delta(after, "vllm:request_prompt_tokens_sum") == prompt_total
    assert delta(after, "vllm:request_generation_tokens_sum") == generated_total
    assert delta(after, "vllm:time_to_first_token_seconds_count") == requests_count
    assert delta(after, "vllm:time_to_first_token_seconds_sum") > 0
    # As in vLLM: one observation per generated token after each request's first.
    assert delta(after, "vllm:time_per_output_token_seconds_count") == generated_total - requests_count
    assert delta(after, "vllm:time_per_output_token_seconds_sum") > 0
    assert delta(after, "vllm:request_params_n_count") == requests_count
    assert delta(after, "vllm:request_params_n_sum") == requests_count  # n = 1 each
    assert delta(after, "vllm:e2e_request_latency_seconds_count") == requests_count
    assert delta(after, "e2e_le_inf") == requests_count
    # Per-step streaming: one token per streamed response; non-streamed responses not counted.
    assert delta(after, "vllm_multistep:tokens_per_response_count") == streamed_tokens
    assert delta(after, "vllm_multistep:tokens_per_response_sum") == streamed_tokens
    assert delta(after, "tokens_per_response_le_1") == streamed_tokens
    windows = delta(after, "vllm_multistep:scheduling_windows_total")
    steps = delta(after, "vllm_multistep:step_host_overhead_seconds_count")
    # 8 steps per window: fewer windows than steps, at least one prefill and one decode window.
    assert 2 <= windows < steps, (windows, steps)
    assert delta(after, "vllm_multistep:pythonization_lag_seconds_count") >= max(m for _, m in STREAMED)
    assert delta(after, "vllm_multistep:pythonization_lag_seconds_sum") > 0
    assert delta(after, "vllm_multistep:step_host_overhead_seconds_sum") > 0
    # Idle again: nothing running or waiting, the KV cache entirely free, no step waiting for responses.
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm_multistep:response_queue_steps"] == 0
    assert after["vllm_multistep:kv_cache_free_blocks"] == after["vllm_multistep:kv_cache_total_blocks"] > 0


SMALL_CACHE = "vllm_model_small_cache"


def test_a_router_sees_the_batch_fill_queue_and_preempt_with_vllms_metrics(server) -> None:
    """The Kubernetes gateway inference extension's model-server protocol, read while sixteen streams
    overfill a 24-block KV cache: requests running and waiting, the KV cache's use, the cache config's
    block size and block count; after: the preemptions, one observation per request of each phase
    (queue, inference, prefill, decode: Triton's vLLM backend PR 92's names), and the tokens per step.
    Sixteen: their prompts alone need more blocks than the cache has, so some wait from their arrival
    on (with eight, all were admitted and waited only when preempted, moments a 50-ms scrape missed
    once in a whole run on a loaded host)."""
    streams, prompt, tokens = 16, 20, 100

    async def run_all() -> list:
        async with grpcaio.InferenceServerClient(server.grpc_url) as client:
            sampling = {"temperature": 0, "max_tokens": tokens, "ignore_eos": True}
            jobs = [
                aio_generate(client, SMALL_CACHE, input_ids=prompt_ids(prompt, 200 + i), sampling=sampling, stream=True)
                for i in range(streams)
            ]
            return await asyncio.gather(*jobs)

    view = watch_as_a_router(server, SMALL_CACHE, lambda: asyncio.run(run_all()))
    assert [(r.error, len(r.token_ids())) for r in view.result] == [(None, tokens)] * streams
    assert view.cache_config["num_gpu_blocks"] == "24" and int(view.cache_config["block_size"]) > 0, view.cache_config
    view.assert_filled_queued_and_preempted(streams, streams * (prompt + tokens))
