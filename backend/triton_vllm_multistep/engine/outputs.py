"""vLLM's RequestOutputs → the boundary's plain EngineOutputs, on the engine's side of it.

Owns the one conversion the engine loop applies to every step's outputs before its sink sees them
(engine/events.py says what the stub reads: per completion the new ids, text, logprobs, finish and
stop reason, cumulative logprob; per request whether it finished, its prompt's length and its first
token's time); must not drop or reorder anything the stub reads.

Copies what vLLM may still change: with the cumulative output kind a CompletionOutput's logprobs
are the sequence's own list, which later steps extend. Runs for every output of every step (the
engine thread's time), so it builds tuples and copies lists, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from triton_vllm_multistep.engine.events import Completion, EngineOutput, TokenLogprob


def plain_logprobs(logprobs: Iterable[dict[int, Any]]) -> list[dict[int, TokenLogprob]]:
    """vLLM's per-token {token id: Logprob} → the same with TokenLogprobs."""
    return [
        {token: TokenLogprob(lp.logprob, lp.rank, lp.decoded_token) for token, lp in step.items()} for step in logprobs
    ]


def plain_output(output: Any) -> EngineOutput:
    """One vLLM RequestOutput as the stub reads it."""
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
    )


def first_token_time(metrics: Any) -> float | None:
    """time.time() of the request's first token: V0's RequestMetrics have it; V1's RequestStateStats
    have the arrival's wall time and the first token's latency from it (0 until there is one)."""
    if hasattr(metrics, "first_token_time"):
        return metrics.first_token_time
    latency = getattr(metrics, "first_token_latency", 0.0)
    return metrics.arrival_time + latency if latency else None


def plain_outputs(outputs: Iterable[Any]) -> list[EngineOutput]:
    """A step's vLLM RequestOutputs as the stub reads them (a new list: V0 reuses and clears its own)."""
    return [plain_output(output) for output in outputs]
