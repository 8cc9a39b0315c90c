"""One request to a Triton LLM model over gRPC, in plain values: what both OpenAI servers share.

Owns the model's side of an OpenAI request without any vLLM: the request's tensors built from plain
values (token ids, the `sampling_parameters` object, which outputs to return), one gRPC stream per
request (read to its FINAL, ended as Triton 2.51 needs), each response's outputs as Python lists,
split into one plain value per completion, and errors told apart as a bad request or the model being
unavailable. The multi-step models' server (vLLM 0.8.5, `.venv`) and the V1 models' (vLLM 0.32,
`.venv-v1`, tritonclient 2.73) each turn these values into their vLLM's objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc._utils import _get_inference_request as inference_request
from tritonclient.grpc._utils import get_error_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from triton_vllm_multistep.frontend.errors import EngineUnavailable, is_unavailable
from triton_vllm_multistep.frontend.tap_listener import OutputTap, TapItem
from triton_vllm_multistep.interface import (
    DIMENSIONS_FIELD,
    EMBEDDING_INPUT_FIELD,
    EMBEDDING_REQUEST,
    FINISH_REASON,
    IMAGE_INPUT,
    INPUT_IDS,
    LOGPROBS,
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
from triton_vllm_multistep.output_tap import TAP_KEY_PARAMETER, TAP_SOCKET_PARAMETER

logger = logging.getLogger("triton_vllm_multistep.frontend")

# SamplingParams fields (the same in vLLM 0.8.5 and 0.32) each OpenAI server sends in
# sampling_parameters when they differ from vLLM's defaults (the backend applies the same defaults).
SENT_SAMPLING_FIELDS = (
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


class UnsupportedRequest(ValueError):
    """What vLLM's serving code asked for that this path cannot give; vLLM answers it with a 400."""


def tokenized_prompt(prompt: Any, lora_request: Any = None, embedding: bool = False) -> list[int]:
    """The token ids of what vLLM's serving code hands an engine client (it tokenizes every prompt first);
    an embedding request with a LoRA adapter is refused (adapters are served for generation only)."""
    if not isinstance(prompt, Mapping) or "prompt_token_ids" not in prompt:
        raise UnsupportedRequest("only tokenized prompts reach this server's engine client")
    if embedding and lora_request is not None:
        raise UnsupportedRequest("LoRA adapters are not served for embedding models")
    return list(prompt["prompt_token_ids"])


def changed_fields(params: Any, defaults: Any) -> dict[str, Any]:
    """SENT_SAMPLING_FIELDS of `params` that differ from `defaults` (vLLM's SamplingParams()), as
    JSON values (logit_bias keys as text)."""
    values: dict[str, Any] = {}
    for name in SENT_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value != getattr(defaults, name) and value is not None:
            values[name] = {str(k): v for k, v in value.items()} if name == "logit_bias" else value
    return values


# Outputs asked of the model for a generation: the backend builds only these (docs/interface.md).
GENERATION_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, FINISH_REASON, NUM_OUTPUT_TOKENS)
# Triton's own request parameters on every request: the empty FINAL tells the client the stream is
# over whatever the last data response said.
FINAL_RESPONSE_PARAMETERS = {"triton_enable_empty_final_response": True}
# How long a stream whose FINAL came may take to be ended by the server (it ends it at once).
STREAM_END_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class TritonRequest:
    """The tensors and request parameters of one inference request to the LLM model."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    parameters: dict[str, bool]  # Triton's own request parameters (FINAL_RESPONSE_PARAMETERS)


def generation_request(
    prompt_token_ids: Sequence[int],
    sampling: Mapping[str, Any],
    stream: bool,
    logprobs: bool = False,
    prompt_logprobs: bool = False,
    images: Sequence[bytes] = (),
    priority: int = 0,
) -> TritonRequest:
    """The request for a tokenized prompt: `sampling` as the `sampling_parameters` object (vLLM field
    names, JSON values), one response per step when `stream`, one whole answer otherwise; the base64
    images its placeholders stand for, in order; the request's `priority` (the model checks it)."""
    inputs = {
        INPUT_IDS: np.asarray(prompt_token_ids, dtype=np.int32),
        STREAM: np.array([stream], dtype=bool),
        SAMPLING_PARAMETERS: np.array([json.dumps(dict(sampling)).encode()], dtype=np.object_),
        RETURN_FINISH_REASON: np.array([True], dtype=bool),
        RETURN_NUM_OUTPUT_TOKENS: np.array([True], dtype=bool),
    }
    outputs = GENERATION_OUTPUTS
    if images:
        inputs[IMAGE_INPUT] = np.array(list(images), dtype=np.object_)
        # The model counts the prompt with its image tokens; vLLM's usage counts it so too.
        inputs[RETURN_NUM_INPUT_TOKENS] = np.array([True], dtype=bool)
        outputs = (*outputs, NUM_INPUT_TOKENS)
    if priority:
        inputs[PRIORITY] = np.array([priority], dtype=np.int32)
    if logprobs:
        inputs[RETURN_LOGPROBS] = np.array([True], dtype=bool)
        outputs = (*outputs, LOGPROBS)
    if prompt_logprobs:
        outputs = (*outputs, PROMPT_LOGPROBS)
    return TritonRequest(inputs, outputs, dict(FINAL_RESPONSE_PARAMETERS))


def embedding_request(prompt_token_ids: Sequence[int], dimensions: int | None, priority: int = 0) -> TritonRequest:
    """The request for an embedding model's tokenized prompt: `embedding_request` (Triton's vLLM backend's
    JSON, `dimensions` as its OpenAI front end sends it), the prompt's token count asked for."""
    pooling = {} if dimensions is None else {DIMENSIONS_FIELD: [dimensions]}
    body = {EMBEDDING_INPUT_FIELD: list(prompt_token_ids), POOLING_PARAMS_FIELD: pooling}
    inputs = {
        EMBEDDING_REQUEST: np.array([json.dumps(body).encode()], dtype=np.object_),
        RETURN_NUM_INPUT_TOKENS: np.array([True], dtype=bool),
    }
    if priority:
        inputs[PRIORITY] = np.array([priority], dtype=np.int32)
    return TritonRequest(inputs, (TEXT_OUTPUT, NUM_INPUT_TOKENS), dict(FINAL_RESPONSE_PARAMETERS))


def embedding_vector(values: Mapping[str, Sequence[Any]]) -> list[float]:
    """An embedding model's vector from its data response (JSON in text_output: each float32 exactly)."""
    return json.loads(values[TEXT_OUTPUT][0])


# One step's logprobs as the backend sends them: {token id (text): {"logprob", "rank", "decoded_token"}}.
StepLogprobs = dict[int, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class CompletionDelta:
    """One completion's part of one data response (its new tokens when streamed, all otherwise)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while unfinished
    logprobs: list[StepLogprobs | None] | None  # per token; None when not asked for


@dataclasses.dataclass(frozen=True)
class ModelAnswer:
    """One data response of the model, in plain values."""

    completions: list[CompletionDelta]
    prompt_logprobs: list[StepLogprobs | None] | None  # on the first response, when asked for
    num_input_tokens: int | None  # when asked for (image prompts: image tokens included)

    @property
    def finished(self) -> bool:
        return all(completion.finish_reason is not None for completion in self.completions)


def model_answer(values: Mapping[str, Sequence[Any]], completions: int) -> ModelAnswer:
    """A data response's outputs (`response_values`) split per completion; raises when the model
    answered another number of completions than asked for."""
    counts = [int(c) for c in values[NUM_OUTPUT_TOKENS]]
    if len(counts) != completions:
        raise RuntimeError(f"the model answered {len(counts)} completion(s), {completions} asked for")
    ids = [int(t) for t in values[OUTPUT_IDS]]
    texts = [_text(t) for t in values[TEXT_OUTPUT]]
    reasons = [_finish_reason(r) for r in values[FINISH_REASON]]
    logprobs = [_logprobs(lp) for lp in values[LOGPROBS]] if LOGPROBS in values else [None] * completions
    parts, start = [], 0
    for index, count in enumerate(counts):
        parts.append(CompletionDelta(index, ids[start : start + count], texts[index], reasons[index], logprobs[index]))
        start += count
    prompt_logprobs = _logprobs(values[PROMPT_LOGPROBS][0]) if PROMPT_LOGPROBS in values else None
    counted = values.get(NUM_INPUT_TOKENS)
    return ModelAnswer(parts, prompt_logprobs, int(counted[0]) if counted else None)


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _finish_reason(value: Any) -> str | None:
    text = _text(value)
    return None if text in ("None", "") else text  # the backend sends str(None) while unfinished


def _logprobs(value: Any) -> list[StepLogprobs | None] | None:
    steps = json.loads(_text(value))
    if steps is None:
        return None
    # None: the first prompt token's
    return [None if step is None else {int(token): entry for token, entry in step.items()} for step in steps]


def logprob_objects(steps: list[StepLogprobs | None] | None, logprob: Callable[..., Any]) -> list[Any] | None:
    """Plain logprob steps as vLLM's: {token id: logprob(logprob=, rank=, decoded_token=)} per step
    (`logprob`: the Logprob class of the serving vLLM), None kept where a step has none."""
    if steps is None:
        return None
    return [
        None
        if step is None  # the first prompt token's
        else {
            token: logprob(logprob=entry["logprob"], rank=entry.get("rank"), decoded_token=entry.get("decoded_token"))
            for token, entry in step.items()
        }
        for step in steps
    ]


def vllm_completions(
    answer: ModelAnswer, completion_output: Callable[..., Any], logprob: Callable[..., Any]
) -> list[Any]:
    """The answer's completions as vLLM's CompletionOutputs (the classes of the serving vLLM)."""
    return [
        completion_output(
            index=part.index,
            text=part.text,
            token_ids=part.token_ids,
            cumulative_logprob=None,
            logprobs=logprob_objects(part.logprobs, logprob),
            finish_reason=part.finish_reason,
        )
        for part in answer.completions
    ]


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


async def end_stream(responses: Any, answered: bool, timeout: float = STREAM_END_SECONDS) -> None:
    """End one gRPC stream (a streaming call's iterator): cancelled when its request is unanswered; otherwise read
    to its end, which the server makes right after the FINAL. Never cancelled once answered: Triton
    2.51's gRPC frontend can lose the state of a stream cancelled while it finishes it, and that state
    keeps its model from ever unloading (docs/lifecycle.md, "A stream cancelled as it ends")."""
    if answered:

        async def read_to_end() -> None:
            async for _ in responses:
                pass  # nothing comes after a FINAL

        try:
            await asyncio.wait_for(read_to_end(), timeout)
            return
        except Exception as error:  # TimeoutError, or the stream failed: nothing more to read from it
            logger.debug("a gRPC stream did not end cleanly after its FINAL (%s): cancelling it", error)
    responses.cancel()


class TritonModelState:
    """An EngineClient's state for a Triton model (mixed into each vLLM's EngineClient): the engine lives
    in Triton; its health is the model's readiness (check_health)."""

    model_name: str

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return EngineUnavailable(f"model {self.model_name} is not available")


async def _one(message: Any) -> AsyncGenerator[Any, None]:
    yield message


@dataclasses.dataclass(frozen=True)
class _StreamData:
    values: dict[str, list[Any]]


class _StreamFinal:
    pass


@dataclasses.dataclass(frozen=True)
class _StreamError:
    message: str


async def _read_stream(responses: Any, inbox: asyncio.Queue[Any]) -> None:
    """A tapped request's gRPC stream into its inbox: data responses (when the stub did not use the
    tap), the FINAL, or the error; read to the stream's end, which the server makes after the FINAL."""
    ended = False
    try:
        async for response in responses:
            if response.error_message:
                ended = True
                inbox.put_nowait(_StreamError(response.error_message))
                continue
            values = response_values(response.infer_response)
            if values:
                inbox.put_nowait(_StreamData(values))
            final = response.infer_response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                ended = True
                inbox.put_nowait(_StreamFinal())
    except grpc.RpcError as error:
        if not ended:
            inbox.put_nowait(_StreamError(str(get_error_grpc(error))))


class ModelStreams:
    """One Triton model's requests over a grpc.aio client (tritonclient's, of either environment)."""

    def __init__(self, client: Any, model_name: str) -> None:
        self._client = client
        self.model_name = model_name
        self._ending: set[asyncio.Future[Any]] = set()  # tapped streams read to their FINAL after their answer

    async def responses(
        self, request_id: str, request: TritonRequest, tap: OutputTap | None = None
    ) -> AsyncGenerator[dict[str, list[Any]], None]:
        """One gRPC stream to the model: each response's output values, until its FINAL. A request's
        error is raised as ValueError (a bad request) or EngineUnavailable (the model cannot serve now).
        With a started `tap`, the stub sends the data responses there (output_tap.py)."""
        if tap is not None and tap.path is not None:
            async with aclosing(self._tapped(request_id, request, tap)) as tapped:
                async for values in tapped:
                    yield values
            return
        responses = self._client._client_stub.ModelStreamInfer(_one(self._request_message(request_id, request)))
        answered = False  # the model's FINAL (or its error) came: the server ends the stream itself
        try:
            async for response in responses:
                if response.error_message:
                    answered = True
                    raise await self.request_error(response.error_message)
                final = response.infer_response.parameters.get("triton_final_response")
                answered = final is not None and final.bool_param
                yield response_values(response.infer_response)
                if answered:
                    return
        except grpc.RpcError as error:  # the stream itself failed (server gone, ...)
            answered = True
            raise await self.request_error(str(get_error_grpc(error))) from None  # in tritonclient's words
        finally:
            # Unanswered: the HTTP client went away (vLLM's serving code was cancelled) or stopped
            # reading; cancelling the gRPC stream makes the backend abort the request in the engine.
            if not answered:
                self._log_left(request_id)
            await end_stream(responses, answered)

    async def _tapped(
        self, request_id: str, request: TritonRequest, tap: OutputTap
    ) -> AsyncGenerator[dict[str, list[Any]], None]:
        """`responses` through the tap: the data responses from the tap's inbox (or from the gRPC stream,
        when the stub could not reach the tap), the FINAL or an error from the gRPC stream."""
        key = uuid.uuid4().hex
        inbox = tap.open(key)
        message = self._request_message(request_id, request)
        message.parameters[TAP_SOCKET_PARAMETER].string_param = tap.path
        message.parameters[TAP_KEY_PARAMETER].string_param = key
        responses = self._client._client_stub.ModelStreamInfer(_one(message))
        reader = asyncio.ensure_future(_read_stream(responses, inbox))
        answered = False  # the last data response (or an error) came: the server ends the stream itself
        try:
            through_triton = False  # data responses came by gRPC: the stub did not use the tap
            final_seen = False
            while True:
                if final_seen:  # Triton's FINAL overtook the tap's last data response
                    try:
                        item = await asyncio.wait_for(inbox.get(), STREAM_END_SECONDS)
                    except TimeoutError:
                        raise EngineUnavailable(
                            f"model {self.model_name} ended the request, but its last response never reached "
                            "this server's output tap"
                        ) from None
                else:
                    item = await inbox.get()
                if isinstance(item, TapItem):
                    yield item.values
                    if item.final:
                        answered = True
                        return
                elif isinstance(item, _StreamData):
                    through_triton = True
                    yield item.values
                elif isinstance(item, _StreamFinal):
                    answered = final_seen = True
                    if through_triton:
                        return
                else:
                    answered = True
                    raise await self.request_error(item.message)
        finally:
            tap.forget(key)
            if answered:  # the FINAL comes (or came): read to it in the background, never cancel
                self._ending.add(reader)
                reader.add_done_callback(self._ending.discard)
            else:  # the client went away: cancelling the stream aborts the request in the engine
                responses.cancel()
                self._log_left(request_id)
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    def _log_left(self, request_id: str) -> None:
        logger.info("request %s left unanswered (its client went away): cancelled in %s", request_id, self.model_name)

    async def embeddings(
        self, request_id: str, prompt_token_ids: Sequence[int], dimensions: int | None, priority: int
    ) -> AsyncGenerator[list[float], None]:
        """An embedding model's vector for a tokenized prompt (its one data response; the FINAL is empty)."""
        request = embedding_request(prompt_token_ids, dimensions, priority)
        async with aclosing(self.responses(request_id, request)) as responses:
            async for values in responses:
                if TEXT_OUTPUT in values:
                    yield embedding_vector(values)

    def _request_message(self, request_id: str, request: TritonRequest) -> Any:
        """The request's ModelInferRequest, built by tritonclient with Triton's own request parameters
        set on it afterwards: tritonclient 2.73 (the V1 environment's) refuses `triton_*` parameters
        from callers and its stream has no option for them; 2.51's takes either way."""
        inputs = []
        for name, array in request.inputs.items():
            tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        message = inference_request(
            model_name=self.model_name,
            inputs=inputs,
            model_version="",
            request_id=request_id,
            outputs=[InferRequestedOutput(name) for name in request.outputs],
            sequence_id=0,
            sequence_start=False,
            sequence_end=False,
            priority=0,
            timeout=None,
            parameters=None,
        )
        for key, value in request.parameters.items():
            message.parameters[key].bool_param = bool(value)
        return message

    async def request_error(self, message: str) -> Exception:
        """A request's error as vLLM's serving code answers it: a ValueError is a 400; the engine
        or model being unavailable is EngineUnavailable (the app answers 503)."""
        if is_unavailable(message) or not await self.ready():
            return EngineUnavailable(message)
        return ValueError(message)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model_name))
        except InferenceServerException:
            return False

    async def check_health(self) -> None:
        if not await self.ready():
            raise EngineUnavailable(f"Triton model {self.model_name} is not ready")
