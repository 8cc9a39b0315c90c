"""An EngineClient for vLLM's OpenAI serving code that streams from a Triton model over gRPC.

Owns one Triton model's side of the OpenAI server: each `generate` is one gRPC stream to the
model (token ids in; per-step deltas or one whole answer out, as vLLM's serving code asks), each
`encode` one to an embedding model (token ids in, one vector out), ended
by the model's FINAL and cancelled when the HTTP client goes away (which aborts the request in
the engine). Tokenizer and ModelConfig are the model's own, read from its model.json.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any

from tritonclient.grpc import aio as grpcclient
from vllm.config import DecodingConfig, ModelConfig
from vllm.engine.protocol import EngineClient
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams

from triton_vllm_multistep.frontend import triton_requests
from triton_vllm_multistep.frontend.tap_listener import OutputTap
from triton_vllm_multistep.frontend.triton_stream import (
    ModelStreams,
    TritonModelState,
    UnsupportedRequest,
    tokenized_prompt,
)
from triton_vllm_multistep.interface import NUM_OUTPUT_TOKENS, encode_image


class ModelConfigOnly:
    """The part of a VllmConfig vLLM's OpenAI serving code reads (its model_config)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config


class TritonEngineClient(TritonModelState, EngineClient):
    """vLLM's EngineClient over one Triton model; `adapters` maps the names its LoRA adapters are
    served under (model names to OpenAI clients) to their names in its multi_lora.json."""

    def __init__(
        self,
        client: grpcclient.InferenceServerClient,
        model_name: str,
        model_config: ModelConfig,
        tokenizer: Any,
        adapters: Mapping[str, str] | None = None,
        tap: OutputTap | None = None,
    ) -> None:
        self._streams = ModelStreams(client, model_name)
        self._tap = tap  # where the model's stub sends the data responses, when it can (output_tap.py)
        self.model_name = model_name
        self._model_config = model_config
        self._tokenizer = tokenizer
        self._adapters = dict(adapters or {})

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
        prompt_ids = tokenized_prompt(prompt)
        media = dict(prompt.get("multi_modal_data") or {})
        images = media.pop("image", [])  # vLLM's modality name
        images = images if isinstance(images, list) else [images]
        if media:
            raise UnsupportedRequest(f"{', '.join(sorted(media))} input is not served (images are)")
        if prompt_adapter_request is not None:
            raise UnsupportedRequest("prompt adapters are not served")
        lora_name = self._adapters.get(lora_request.lora_name) if lora_request is not None else None
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
        async with aclosing(self._streams.responses(request_id, request, self._tap)) as responses:
            async for values in responses:
                if NUM_OUTPUT_TOKENS in values:  # a data response (the empty FINAL has none)
                    output = triton_requests.request_output(request_id, prompt_ids, values, completions)
                    if first:
                        output.prompt = self._tokenizer.decode(prompt_ids)
                        first = False
                    yield output

    async def check_health(self) -> None:
        await self._streams.check_health()

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
        raise UnsupportedRequest("beam search is not served (use n / best_of)")

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
        prompt_ids = tokenized_prompt(prompt, lora_request, embedding=True)
        return self._pooled(request_id, prompt_ids, pooling_params.dimensions, priority)

    async def _pooled(
        self, request_id: str, prompt_ids: list[int], dimensions: int | None, priority: int
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        async with aclosing(self._streams.embeddings(request_id, prompt_ids, dimensions, priority)) as vectors:
            async for vector in vectors:
                yield triton_requests.pooling_output(request_id, prompt_ids, vector)

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
