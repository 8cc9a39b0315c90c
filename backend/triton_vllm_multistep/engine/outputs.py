"""vLLM's RequestOutputs → the boundary's plain EngineOutputs, on the engine's side of it.

Owns the one conversion the engine loop applies to every step's outputs before its sink sees them
(engine/events.py says what the stub reads: per completion the new ids, text, logprobs, finish and
stop reason, cumulative logprob; per request whether it finished, its prompt's length, its first
token's time and, once finished, its timings and cache use); must not drop or reorder anything the stub reads.

Copies what vLLM may still change: with the cumulative output kind a CompletionOutput's logprobs
are the sequence's own list, which later steps extend. Runs for every output of every step (the
engine thread's time), so it builds tuples and copies lists, nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from triton_vllm_multistep.engine.events import Completion, EngineOutput, RequestTimes, TokenLogprob


def plain_step(step: dict[int, Any]) -> dict[int, TokenLogprob]:
    """One position's vLLM {token id: Logprob} → the same with TokenLogprobs."""
    return {token: TokenLogprob(lp.logprob, lp.rank, lp.decoded_token) for token, lp in step.items()}


def plain_logprobs(logprobs: Iterable[dict[int, Any]]) -> list[dict[int, TokenLogprob]]:
    """vLLM's per-token {token id: Logprob} → the same with TokenLogprobs."""
    return [plain_step(step) for step in logprobs]


def plain_output(output: Any) -> EngineOutput:
    """One vLLM RequestOutput (or an embedding request's PoolingRequestOutput) as the stub reads it."""
    if not isinstance(output.outputs, list):  # a PoolingOutput: one tensor, no completions
        return plain_pooling_output(output)
    prompt = output.prompt_token_ids
    metrics = output.metrics
    return EngineOutput(
        output.request_id,
        [
            Completion(
                c.index,
                c.text,
                list(c.token_ids),
                c.cumulative_logprob,
                None if c.logprobs is None else plain_logprobs(c.logprobs),
                c.finish_reason,
                c.stop_reason,
            )
            for c in output.outputs
        ],
        output.finished,
        None if prompt is None else len(prompt),
        None if metrics is None else first_token_time(metrics),
        request_times(output) if output.finished else None,
        # V1's later delta outputs carry [] once its first one took them: none.
        plain_prompt_logprobs(output.prompt_logprobs) if output.prompt_logprobs else None,
    )


def plain_pooling_output(output: Any) -> EngineOutput:
    """An embedding request's PoolingRequestOutput (vLLM 0.8.5's and V1's: its one, finished output,
    the embedding a 1-D float32 tensor in `outputs.data`; neither engine keeps its timings)."""
    prompt = output.prompt_token_ids
    return EngineOutput(
        output.request_id,
        [],
        output.finished,
        None if prompt is None else len(prompt),
        embedding=output.outputs.data.reshape(-1).tolist(),
    )


def plain_prompt_logprobs(logprobs: Iterable[dict[int, Any] | None]) -> list[dict[int, TokenLogprob] | None]:
    """vLLM's prompt logprobs (None for the first prompt token; V1's flat form yields {} there) → the
    same with TokenLogprobs."""
    return [plain_step(step) if step else None for step in logprobs]


def first_token_time(metrics: Any) -> float | None:
    """time.time() of the request's first token: V0's RequestMetrics have it; V1's RequestStateStats
    have the arrival's wall time and the first token's latency from it (0 until there is one)."""
    if hasattr(metrics, "first_token_time"):
        return metrics.first_token_time
    latency = getattr(metrics, "first_token_latency", 0.0)
    return metrics.arrival_time + latency if latency else None


def request_times(output: Any) -> RequestTimes | None:
    """A finished request's timings as its engine kept them (None without metrics: V1 with stats off).

    V0's RequestMetrics are wall-clock already. V1 keeps the arrival on the wall clock and the rest as
    its engine core's time.monotonic() stamps (0 where unset); CLOCK_MONOTONIC is one clock for every
    process of the host, so each stamp moves to the wall clock by the offset between the two now."""
    metrics = output.metrics
    if metrics is None:
        return None
    cached = getattr(output, "num_cached_tokens", None) or 0
    if hasattr(metrics, "first_scheduled_time"):  # V0
        return RequestTimes(
            metrics.arrival_time,
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time if metrics.first_token_time is not None else None,
            cached,
        )
    offset = time.time() - time.monotonic()

    def wall(stamp: float) -> float | None:
        return stamp + offset if stamp else None

    return RequestTimes(
        metrics.arrival_time or None,
        wall(metrics.scheduled_ts),
        wall(metrics.first_token_ts),
        wall(metrics.last_token_ts),
        cached,
    )


def plain_outputs(outputs: Iterable[Any]) -> list[EngineOutput]:
    """A step's vLLM RequestOutputs as the stub reads them (a new list: V0 reuses and clears its own)."""
    return [plain_output(output) for output in outputs]
