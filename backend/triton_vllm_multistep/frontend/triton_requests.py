"""Triton requests from vLLM 0.8.5's SamplingParams, and its RequestOutputs from Triton responses.

Owns the mapping between what vLLM 0.8.5's OpenAI serving code hands an EngineClient and the
model's KServe v2 tensors (docs/interface.md; the tensors themselves are frontend/triton_stream.py's,
shared with the V1 models' server); pure logic, no network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.sequence import Logprob

from triton_vllm_multistep.frontend.triton_stream import (
    TritonRequest,
    UnsupportedRequest,
    changed_fields,
    generation_request,
    logprob_objects,
    model_answer,
    vllm_completions,
)
from triton_vllm_multistep.interface import (
    LORA_NAME_FIELD,
)

# Beside triton_stream's SENT_SAMPLING_FIELDS, `n`/`best_of` and `guided_decoding` are sent on their
# own; `truncate_prompt_tokens` is applied by vLLM's serving code before the prompt gets here.
_DEFAULTS = SamplingParams()


def sampling_parameters(params: SamplingParams, lora_name: str | None = None) -> dict[str, Any]:
    """The `sampling_parameters` JSON object for `params` (vLLM field names and meanings)."""
    if params.logits_processors:
        raise UnsupportedRequest("logits processors (e.g. logits_processor_pattern) are not accepted by this server")
    values: dict[str, Any] = {}
    requested_n = params._real_n or params.n  # vLLM moved n to best_of when best_of > n
    values["n"] = requested_n
    values["max_tokens"] = params.max_tokens  # always: the backend's own default differs from vLLM's server's
    if params.best_of is not None and params.best_of != requested_n:
        values["best_of"] = params.best_of
    values.update(changed_fields(params, _DEFAULTS))
    if params.guided_decoding is not None:
        guided = {k: v for k, v in dataclasses.asdict(params.guided_decoding).items() if v not in (None, False)}
        guided.pop("disable_fallback", None)  # not a field of vLLM 0.8.5's GuidedDecodingParams
        values["guided_decoding"] = guided
    if lora_name is not None:
        values[LORA_NAME_FIELD] = lora_name
    return values


def triton_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    lora_name: str | None,
    images: Sequence[bytes] = (),
    priority: int = 0,
) -> TritonRequest:
    """The request for a tokenized prompt (and the base64 images its placeholders stand for, in
    order): streamed (one response per step) when vLLM asks for deltas, one response otherwise;
    vLLM's request `priority` as the model's `priority` input (the model checks it)."""
    return generation_request(
        prompt_token_ids,
        sampling_parameters(params, lora_name),
        stream=params.output_kind == RequestOutputKind.DELTA,
        logprobs=params.logprobs is not None,
        prompt_logprobs=params.prompt_logprobs is not None,
        images=images,
        priority=priority,
    )


def pooling_output(request_id: str, prompt_token_ids: list[int], vector: list[float]) -> PoolingRequestOutput:
    """An embedding model's vector (float32 values, carried exactly by JSON) as vLLM's PoolingRequestOutput."""
    import torch

    return PoolingRequestOutput(
        request_id, PoolingOutput(torch.tensor(vector, dtype=torch.float32)), prompt_token_ids, True
    )


def request_output(
    request_id: str,
    prompt_token_ids: list[int],
    arrays: Mapping[str, Sequence[Any]],
    completions: int,
) -> RequestOutput:
    """vLLM's RequestOutput for one data response: one CompletionOutput per completion, with the
    response's tokens (new ones when streamed, all of them otherwise). An image prompt's ids are
    extended to the count the model reports (`num_input_tokens`, image tokens included): vLLM's
    serving code reads only their number (usage)."""
    answer = model_answer(arrays, completions)
    outputs = vllm_completions(answer, CompletionOutput, Logprob)
    counted = answer.num_input_tokens
    if counted is not None and counted > len(prompt_token_ids) and prompt_token_ids:
        prompt_token_ids = prompt_token_ids + [prompt_token_ids[-1]] * (counted - len(prompt_token_ids))
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=logprob_objects(answer.prompt_logprobs, Logprob),
        outputs=outputs,
        finished=answer.finished,
    )
