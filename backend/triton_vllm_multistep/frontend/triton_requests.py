"""Triton requests from vLLM's SamplingParams, and vLLM RequestOutputs from Triton responses.

Owns the mapping between what vLLM's OpenAI serving code hands an EngineClient and the model's
KServe v2 tensors (docs/interface.md); pure logic, no network.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from vllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.sequence import Logprob

from triton_vllm_multistep.interface import (
    DIMENSIONS_FIELD,
    EMBEDDING_INPUT_FIELD,
    EMBEDDING_REQUEST,
    FINISH_REASON,
    IMAGE_INPUT,
    INPUT_IDS,
    LOGPROBS,
    LORA_NAME_FIELD,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    POOLING_PARAMS_FIELD,
    PRIORITY,
    PROMPT_LOGPROBS,
    RETURN_FINISH_REASON,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    SAMPLING_PARAMETERS,
    STREAM,
    TEXT_OUTPUT,
)

# SamplingParams fields sent in sampling_parameters when they differ from vLLM's defaults (the
# backend applies the same defaults). `n`/`best_of` and `guided_decoding` are sent on their own;
# `truncate_prompt_tokens` is applied by vLLM's serving code before the prompt gets here.
SENT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",  # echo with logprobs, or asked for: the model returns them on its first response
)
_DEFAULTS = SamplingParams()
# Outputs asked of the model: the backend builds only these (docs/interface.md).
OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, FINISH_REASON, NUM_OUTPUT_TOKENS)


class UnsupportedRequest(ValueError):
    """What vLLM's serving code asked for that this path cannot give; vLLM answers it with a 400."""


@dataclasses.dataclass(frozen=True)
class TritonRequest:
    """The tensors and request parameters of one inference request to the LLM model."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    parameters: dict[str, Any]


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
    for name in SENT_FIELDS:
        value = getattr(params, name)
        if value != getattr(_DEFAULTS, name) and value is not None:
            values[name] = {str(k): v for k, v in value.items()} if name == "logit_bias" else value
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
    stream = params.output_kind == RequestOutputKind.DELTA
    inputs = {
        INPUT_IDS: np.asarray(prompt_token_ids, dtype=np.int32),
        STREAM: np.array([stream], dtype=bool),
        SAMPLING_PARAMETERS: np.array([json.dumps(sampling_parameters(params, lora_name)).encode()], dtype=np.object_),
        RETURN_FINISH_REASON: np.array([True], dtype=bool),
        RETURN_NUM_OUTPUT_TOKENS: np.array([True], dtype=bool),
    }
    outputs = OUTPUTS
    if images:
        inputs[IMAGE_INPUT] = np.array(list(images), dtype=np.object_)
        # The model counts the prompt with its image tokens; vLLM's usage counts it so too.
        inputs[RETURN_NUM_INPUT_TOKENS] = np.array([True], dtype=bool)
        outputs = (*outputs, NUM_INPUT_TOKENS)
    if priority:
        inputs[PRIORITY] = np.array([priority], dtype=np.int32)
    if params.logprobs is not None:
        inputs[RETURN_LOGPROBS] = np.array([True], dtype=bool)
        outputs = (*outputs, LOGPROBS)
    if params.prompt_logprobs is not None:
        outputs = (*outputs, PROMPT_LOGPROBS)
    # The empty FINAL tells the client the stream is over whatever the last data response said.
    return TritonRequest(inputs, outputs, {"triton_enable_empty_final_response": True})


def embedding_request(prompt_token_ids: Sequence[int], params: PoolingParams, priority: int = 0) -> TritonRequest:
    """The request for an embedding model's tokenized prompt: `embedding_request` (Triton's vLLM backend's
    JSON, `dimensions` as its OpenAI front end sends it), the prompt's token count asked for."""
    pooling = {} if params.dimensions is None else {DIMENSIONS_FIELD: [params.dimensions]}
    body = {EMBEDDING_INPUT_FIELD: list(prompt_token_ids), POOLING_PARAMS_FIELD: pooling}
    inputs = {
        EMBEDDING_REQUEST: np.array([json.dumps(body).encode()], dtype=np.object_),
        RETURN_NUM_INPUT_TOKENS: np.array([True], dtype=bool),
    }
    if priority:
        inputs[PRIORITY] = np.array([priority], dtype=np.int32)
    return TritonRequest(inputs, (TEXT_OUTPUT, NUM_INPUT_TOKENS), {"triton_enable_empty_final_response": True})


def pooling_output(
    request_id: str, prompt_token_ids: list[int], arrays: Mapping[str, Sequence[Any]]
) -> PoolingRequestOutput:
    """An embedding model's response (the vector as JSON in text_output) as vLLM's PoolingRequestOutput:
    the float32 values the engine computed (JSON carries each exactly)."""
    import torch

    vector = json.loads(arrays[TEXT_OUTPUT][0])
    return PoolingRequestOutput(
        request_id, PoolingOutput(torch.tensor(vector, dtype=torch.float32)), prompt_token_ids, True
    )


def response_values(response: Any) -> dict[str, list[Any]]:
    """A ModelInferResponse's outputs as Python lists, read from its raw contents directly (the
    per-response cost of the OpenAI path: tritonclient's as_numpy builds an array per output). BYTES
    elements are bytes; INT32/UINT32 are read in the host's byte order, which is KServe's little
    endian on every platform Triton runs on (x86-64, aarch64)."""
    values: dict[str, list[Any]] = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        if output.datatype == "BYTES":
            values[output.name] = _bytes_elements(raw)
        elif output.datatype in _INTEGER_FORMATS:
            values[output.name] = memoryview(raw).cast(_INTEGER_FORMATS[output.datatype]).tolist()
    return values


_INTEGER_FORMATS = {"INT32": "i", "UINT32": "I"}


def _bytes_elements(raw: bytes) -> list[bytes]:
    """KServe's BYTES encoding: each element a 4-byte little-endian length, then its bytes."""
    elements, offset = [], 0
    while offset < len(raw):
        size = int.from_bytes(raw[offset : offset + 4], "little")
        elements.append(raw[offset + 4 : offset + 4 + size])
        offset += 4 + size
    return elements


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
    counts = [int(c) for c in arrays[NUM_OUTPUT_TOKENS]]
    if len(counts) != completions:
        raise RuntimeError(f"the model answered {len(counts)} completion(s), {completions} asked for")
    ids = [int(t) for t in arrays[OUTPUT_IDS]]
    texts = [_text(t) for t in arrays[TEXT_OUTPUT]]
    reasons = [_finish_reason(r) for r in arrays[FINISH_REASON]]
    logprobs = [_logprobs(lp) for lp in arrays[LOGPROBS]] if LOGPROBS in arrays else [None] * completions
    prompt_logprobs = _logprobs(arrays[PROMPT_LOGPROBS][0]) if PROMPT_LOGPROBS in arrays else None
    outputs = []
    start = 0
    for index, count in enumerate(counts):
        outputs.append(
            CompletionOutput(
                index=index,
                text=texts[index],
                token_ids=ids[start : start + count],
                cumulative_logprob=None,
                logprobs=logprobs[index],
                finish_reason=reasons[index],
            )
        )
        start += count
    if arrays.get(NUM_INPUT_TOKENS) is not None:
        counted = int(arrays[NUM_INPUT_TOKENS][0])
        if counted > len(prompt_token_ids) and prompt_token_ids:
            prompt_token_ids = prompt_token_ids + [prompt_token_ids[-1]] * (counted - len(prompt_token_ids))
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=outputs,
        finished=all(reason is not None for reason in reasons),
    )


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _finish_reason(value: Any) -> str | None:
    text = _text(value)
    return None if text in ("None", "") else text  # the backend sends str(None) while unfinished


def _logprobs(value: Any) -> list[dict[int, Logprob] | None] | None:
    steps = json.loads(_text(value))
    if steps is None:
        return None
    return [
        None
        if step is None  # the first prompt token's
        else {
            int(token): Logprob(
                logprob=entry["logprob"], rank=entry.get("rank"), decoded_token=entry.get("decoded_token")
            )
            for token, entry in step.items()
        }
        for step in steps
    ]
