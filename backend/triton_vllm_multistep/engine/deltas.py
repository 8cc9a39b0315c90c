"""Folding a stream's consecutive delta outputs into one: what "several engine outputs as one" means.

Owns the rule, for every engine's plain outputs (engine/events.py): per completion (by index) the
text, token ids and logprobs are concatenated in order, and everything that describes the latest
state (cumulative logprob, finish and stop reason, `finished`, the first token's time) is taken from
the later output. The outputs are never modified: a merge builds new ones. Used by the stub's
responder (`stream_interval`, the "merge" stream mode) and by the V1 engine process (a step's
per-completion outputs of one request, engine_v1/completions.py).
"""

from __future__ import annotations

from typing import Any

from triton_vllm_multistep.engine.events import Completion, EngineOutput


def merge_deltas(earlier: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One delta output equal to sending `earlier` then `later` (same request, streamed)."""
    by_index: dict[int, Completion] = {c.index: c for c in earlier.outputs}
    for completion in later.outputs:
        before = by_index.get(completion.index)
        by_index[completion.index] = completion if before is None else _merge_completion(before, completion)
    return EngineOutput(
        later.request_id,
        [by_index[index] for index in sorted(by_index)],
        later.finished,
        # A delta carries the prompt's length only in a request's first output; the merge keeps it.
        later.prompt_tokens if later.prompt_tokens is not None else earlier.prompt_tokens,
        later.first_token_time,
        later.times,
        later.prompt_logprobs if later.prompt_logprobs is not None else earlier.prompt_logprobs,
    )


def _merge_completion(earlier: Completion, later: Completion) -> Completion:
    return Completion(
        later.index,
        earlier.text + later.text,
        [*earlier.token_ids, *later.token_ids],
        later.cumulative_logprob,
        _concat(earlier.logprobs, later.logprobs),
        later.finish_reason,
        later.stop_reason,
    )


def _concat(earlier: list[Any] | None, later: list[Any] | None) -> list[Any] | None:
    if earlier is None and later is None:
        return None
    return [*(earlier or []), *(later or [])]
