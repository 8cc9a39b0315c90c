"""Triton requests from vLLM 0.32's SamplingParams, and its RequestOutputs from Triton responses.

Owns the mapping between what vLLM 0.32's OpenAI serving code hands an EngineClient and a V1
model's request (the tensors are frontend/triton_stream.py's, shared with the multi-step models'
server); pure logic, no network. Runs in `.venv-v1`: imports vLLM 0.32, never the stub's vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from triton_vllm_multistep.frontend.triton_stream import (
    SENT_SAMPLING_FIELDS,
    TritonRequest,
    UnsupportedRequest,
    changed_fields,
    generation_request,
    logprob_objects,
    model_answer,
    vllm_completions,
)
from triton_vllm_multistep.interface import LORA_NAME_FIELD

# Sent: triton_stream's SENT_SAMPLING_FIELDS when they differ from vLLM's defaults (the V1 engine
# process builds V1's SamplingParams from them with the same defaults), and these on their own.
SENT_ON_THEIR_OWN = frozenset({"n", "max_tokens", "structured_outputs"})
# How the answer is handed out, not what it is: the request's stream mode stands for output_kind.
PRESENTATION_FIELDS = frozenset({"output_kind", "skip_clone", "flat_logprobs"})
# Fields vLLM sets itself from others; the V1 engine process derives them again from what is sent.
DERIVED_FIELDS = {
    "skip_reading_prefix_cache": lambda params: params.prompt_logprobs is not None
    or params.prompt_logprob_token_ids is not None,
}
_DEFAULTS = SamplingParams()


def sampling_parameters(params: SamplingParams, lora_name: str | None = None) -> dict[str, Any]:
    """The `sampling_parameters` object for `params` (vLLM's field names and meanings); a field this
    path cannot carry, set to other than its default, is refused by name (never dropped)."""
    values: dict[str, Any] = {"n": params.n, "max_tokens": params.max_tokens}
    values.update(changed_fields(params, _DEFAULTS))
    for name in _public_fields(params):
        if name not in SENT_SAMPLING_FIELDS and name not in SENT_ON_THEIR_OWN and name not in PRESENTATION_FIELDS:
            derived = DERIVED_FIELDS.get(name)
            if derived is not None and getattr(params, name) == derived(params):
                continue
            if getattr(params, name) != getattr(_DEFAULTS, name):
                raise UnsupportedRequest(f"{name} is not served through this API (set to {getattr(params, name)!r})")
    if params.structured_outputs is not None:
        constraint = {
            key: value
            for key, value in dataclasses.asdict(params.structured_outputs).items()
            if not key.startswith("_") and value not in (None, False)
        }
        values["structured_outputs"] = constraint
    if lora_name is not None:
        values[LORA_NAME_FIELD] = lora_name
    return values


def _public_fields(params: SamplingParams) -> list[str]:
    return [name for name in type(params).__struct_fields__ if not name.startswith("_")]


def triton_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, lora_name: str | None, priority: int = 0
) -> TritonRequest:
    """The request for a tokenized prompt: one response per step when vLLM asks for deltas, one
    whole answer otherwise (a final-only or cumulative output: the last cumulative output is the whole)."""
    return generation_request(
        prompt_token_ids,
        sampling_parameters(params, lora_name),
        stream=params.output_kind == RequestOutputKind.DELTA,
        logprobs=params.logprobs is not None,
        prompt_logprobs=params.prompt_logprobs is not None,
        priority=priority,
    )


def request_output(
    request_id: str, prompt_token_ids: list[int], arrays: Mapping[str, Sequence[Any]], completions: int
) -> RequestOutput:
    """vLLM 0.32's RequestOutput for one data response: one CompletionOutput per completion, with the
    response's tokens (new ones when streamed, all of them otherwise)."""
    answer = model_answer(arrays, completions)
    outputs = vllm_completions(answer, CompletionOutput, Logprob)
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=logprob_objects(answer.prompt_logprobs, Logprob),
        outputs=outputs,
        finished=answer.finished,
    )


def new_parts(completions: Sequence[Any], finish_sent: set[int]) -> list[Any]:
    """Of one streamed step's n completions (the model answers all of them), those V1's own engine
    would stream: with new tokens, or finishing (once; `finish_sent` remembers which did)."""
    parts = []
    for completion in completions:
        finishing = completion.finish_reason is not None and completion.index not in finish_sent
        if completion.token_ids or finishing:
            parts.append(completion)
        if finishing:
            finish_sent.add(completion.index)
    return parts
