"""An EngineClient for vLLM's OpenAI serving code that streams from a Triton model over gRPC.

Owns one Triton model's side of the OpenAI server: each `generate` is one gRPC stream to the
model (token ids in; per-step deltas or one whole answer out, as vLLM's serving code asks), each
`encode` one to an embedding model (token ids in, one vector out), ended
by the model's FINAL and cancelled when the HTTP client goes away (which aborts the request in
the engine). Tokenizer and ModelConfig are the model's own, read from its model.json.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any

from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc import aio as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype
from vllm.config import DecodingConfig, ModelConfig
from vllm.engine.protocol import EngineClient
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams

from triton_vllm_multistep.frontend import triton_requests
from triton_vllm_multistep.frontend.errors import EngineUnavailable, is_unavailable
from triton_vllm_multistep.interface import NUM_OUTPUT_TOKENS, TEXT_OUTPUT, encode_image

logger = logging.getLogger("triton_vllm_multistep.frontend")


# How long a stream whose FINAL came may take to be ended by the server (it ends it at once).
STREAM_END_SECONDS = 5.0


async def end_stream(responses: Any, answered: bool, timeout: float = STREAM_END_SECONDS) -> None:
    """End one gRPC stream of `stream_infer`: cancelled when its request is unanswered; otherwise read
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


class ModelConfigOnly:
    """The part of a VllmConfig vLLM's OpenAI serving code reads (its model_config)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config


class TritonEngineClient(EngineClient):
    """vLLM's EngineClient over one Triton model; `adapters` maps the names its LoRA adapters are
    served under (model names to OpenAI clients) to their names in its multi_lora.json."""

    def __init__(
        self,
        client: grpcclient.InferenceServerClient,
        model_name: str,
        model_config: ModelConfig,
        tokenizer: Any,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        self.model_name = model_name
        self._model_config = model_config
        self._tokenizer = tokenizer
        self._adapters = dict(adapters or {})

    # State: the engine lives in Triton; its health is the model's readiness (check_health).
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

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        prompt_adapter_request: Any = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Checks the request (a ValueError here is vLLM's 400), then returns its stream of outputs."""
        if not isinstance(prompt, Mapping) or "prompt_token_ids" not in prompt:
            raise triton_requests.UnsupportedRequest("only tokenized prompts reach this server's engine client")
        media = dict(prompt.get("multi_modal_data") or {})
        images = media.pop("image", [])  # vLLM's modality name
        images = images if isinstance(images, list) else [images]
        if media:
            raise triton_requests.UnsupportedRequest(f"{', '.join(sorted(media))} input is not served (images are)")
        if prompt_adapter_request is not None:
            raise triton_requests.UnsupportedRequest("prompt adapters are not served")
        lora_name = self._adapters.get(lora_request.lora_name) if lora_request is not None else None
        prompt_ids = list(prompt["prompt_token_ids"])
        completions = sampling_params._real_n or sampling_params.n
        return self._stream(request_id, prompt_ids, sampling_params, lora_name, images, completions, priority)

    async def _stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora_name: str | None,
        images: list[Any],
        completions: int,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        # vLLM's chat code hands over decoded PIL images; the model's `image` input takes them
        # base64-encoded (PNG: lossless, so the model decodes the same pixels), encoded off the loop.
        encoded = await asyncio.to_thread(lambda: [encode_image(image) for image in images]) if images else []
        request = triton_requests.triton_request(prompt_ids, params, lora_name, encoded, priority)
        # vLLM's streaming completions read the prompt's text from the first output to echo it (its
        # whole answers take the request's own); the prompt reaches this client as token ids only.
        first = params.output_kind == RequestOutputKind.DELTA
        # Closed with this generator (vLLM's code closing it cancels the gRPC stream at once).
        async with aclosing(self._responses(request_id, request)) as responses:
            async for values in responses:
                if NUM_OUTPUT_TOKENS in values:  # a data response (the empty FINAL has none)
                    output = triton_requests.request_output(request_id, prompt_ids, values, completions)
                    if first:
                        output.prompt = self._tokenizer.decode(prompt_ids)
                        first = False
                    yield output

    async def _responses(
        self, request_id: str, request: triton_requests.TritonRequest
    ) -> AsyncGenerator[dict[str, list[Any]], None]:
        """One gRPC stream to the model: each response's output values, until its FINAL."""
        inputs = []
        for name, array in request.inputs.items():
            tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [InferRequestedOutput(name) for name in request.outputs]

        async def one_request():
            yield {
                "model_name": self.model_name,
                "inputs": inputs,
                "outputs": outputs,
                "request_id": request_id,
                "parameters": request.parameters,
            }

        responses = self._client.stream_infer(one_request())
        answered = False  # the model's FINAL (or its error) came: the server ends the stream itself
        try:
            async for result, error in responses:
                if error is not None:
                    answered = True
                    raise await self._request_error(str(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                answered = final is not None and final.bool_param
                yield triton_requests.response_values(response)
                if answered:
                    return
        except InferenceServerException as error:  # the stream itself failed (server gone, ...)
            answered = True
            raise await self._request_error(str(error)) from None
        finally:
            # Unanswered: the HTTP client went away (vLLM's serving code was cancelled) or stopped
            # reading; cancelling the gRPC stream makes the backend abort the request in the engine.
            await end_stream(responses, answered)

    async def _request_error(self, message: str) -> Exception:
        """A request's error as vLLM's serving code answers it: a ValueError is a 400; the engine
        or model being unavailable is EngineUnavailable (the app answers 503)."""
        if is_unavailable(message) or not await self._model_ready():
            return EngineUnavailable(message)
        return ValueError(message)

    async def _model_ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model_name))
        except InferenceServerException:
            return False

    async def check_health(self) -> None:
        if not await self._model_ready():
            raise EngineUnavailable(f"Triton model {self.model_name} is not ready")

    # What vLLM's serving code reads about the model.
    async def get_vllm_config(self) -> Any:
        return ModelConfigOnly(self._model_config)

    async def get_model_config(self) -> ModelConfig:
        return self._model_config

    async def get_decoding_config(self) -> DecodingConfig:
        return DecodingConfig()

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        return self._tokenizer

    async def get_input_preprocessor(self) -> Any:
        raise triton_requests.UnsupportedRequest("beam search is not served (use n / best_of)")

    async def add_lora(self, lora_request: LoRARequest) -> None:
        if lora_request.lora_name not in self._adapters:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} is not in model {self.model_name}'s multi_lora.json"
            )

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self, scheduler_outputs: Any = None, model_output: Any = None) -> None:
        return None  # the model's metrics are Triton's (its metrics port)

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """An embedding model's request (vLLM's embedding serving code): one vector for a tokenized prompt."""
        if not isinstance(prompt, Mapping) or "prompt_token_ids" not in prompt:
            raise triton_requests.UnsupportedRequest("only tokenized prompts reach this server's engine client")
        if lora_request is not None:
            raise triton_requests.UnsupportedRequest("LoRA adapters are not served for embedding models")
        prompt_ids = list(prompt["prompt_token_ids"])
        return self._pooled(
            request_id, prompt_ids, triton_requests.embedding_request(prompt_ids, pooling_params, priority)
        )

    async def _pooled(
        self, request_id: str, prompt_ids: list[int], request: triton_requests.TritonRequest
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        async with aclosing(self._responses(request_id, request)) as responses:
            async for values in responses:
                if TEXT_OUTPUT in values:  # the data response (the empty FINAL has none)
                    yield triton_requests.pooling_output(request_id, prompt_ids, values)

    # Engine control that belongs to the Triton model, not to this server.

    async def abort(self, request_id: str) -> None:
        return None  # a request is aborted by cancelling its gRPC stream (see _stream)

    async def start_profile(self) -> None:
        raise NotImplementedError("profiling runs in the Triton model")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling runs in the Triton model")

    async def reset_prefix_cache(self, device: Any = None) -> None:
        raise NotImplementedError("the prefix cache belongs to the Triton model")

    async def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("sleep mode is not served")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("sleep mode is not served")

    async def is_sleeping(self) -> bool:
        return False
