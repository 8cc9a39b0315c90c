"""Folding a stream's consecutive delta outputs into one, for responses that carry several steps.

Owns what "several engine outputs as one response" means: per completion (by index) the text,
token ids and logprobs are concatenated in order, and everything that describes the latest state
(cumulative logprob, finish and stop reason, `finished`, metrics) is taken from the later output.
The engine's objects are never modified: a merge builds new ones, of the inputs' own classes
(vLLM's RequestOutput and CompletionOutput), so this module imports no vLLM and the responder stays
light to import. Used by the responder for `stream_interval` and the "merge" stream mode.
"""

from __future__ import annotations

from typing import Any


def merge_deltas(earlier: Any, later: Any) -> Any:
    """One delta output (a vLLM RequestOutput) equal to sending `earlier` then `later` (same request, streamed)."""
    by_index: dict[int, Any] = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        before = by_index.get(completion.index)
        by_index[completion.index] = completion if before is None else _merge_completion(before, completion)
    return type(later)(
        request_id=later.request_id,
        prompt=later.prompt,
        prompt_token_ids=later.prompt_token_ids,
        prompt_logprobs=later.prompt_logprobs if later.prompt_logprobs is not None else earlier.prompt_logprobs,
        outputs=[by_index[index] for index in sorted(by_index)],
        finished=later.finished,
        metrics=later.metrics,
        lora_request=later.lora_request,
        encoder_prompt=later.encoder_prompt,
        encoder_prompt_token_ids=later.encoder_prompt_token_ids,
        num_cached_tokens=later.num_cached_tokens,
    )


def _merge_completion(earlier: Any, later: Any) -> Any:
    return type(later)(
        index=later.index,
        text=earlier.text + later.text,
        token_ids=[*earlier.token_ids, *later.token_ids],
        cumulative_logprob=later.cumulative_logprob,
        logprobs=_concat(earlier.logprobs, later.logprobs),
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        lora_request=later.lora_request,
    )


def _concat(earlier: list[Any] | None, later: list[Any] | None) -> list[Any] | None:
    if earlier is None and later is None:
        return None
    return [*(earlier or []), *(later or [])]
