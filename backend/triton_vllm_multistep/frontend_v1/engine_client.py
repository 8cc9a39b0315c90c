"""vLLM 0.32's EngineClient over one `vllm_engine: v1` Triton model, for vLLM 0.32's OpenAI app.

Owns what vLLM 0.32's serving code reads of an engine: its VllmConfig, ModelConfig, renderer
(tokenizer and chat template, loaded in `.venv-v1` by V1's own code) and input processor, built from
the model's engine arguments without an engine; each `generate` one gRPC stream to the model (the
renderer's token ids in, per-step deltas or one whole answer out), cancelled when the HTTP client
goes away, which aborts the request in the engine; each `encode` (an embedding model's) one
`embedding_request` to it. Runs in `.venv-v1` with tritonclient 2.73.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from contextlib import aclosing
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.protocol import EngineClient
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor

from triton_vllm_multistep.frontend.errors import EngineUnavailable
from triton_vllm_multistep.frontend.tap_listener import OutputTap
from triton_vllm_multistep.frontend.triton_stream import (
    ModelStreams,
    TritonModelState,
    UnsupportedRequest,
    tokenized_prompt,
)
from triton_vllm_multistep.frontend_v1 import triton_requests
from triton_vllm_multistep.frontend_v1.triton_requests import new_parts
from triton_vllm_multistep.interface import NUM_OUTPUT_TOKENS

# The pooling task an embedding model serves here: Triton's vLLM backend's `embedding_request`.
EMBED = "embed"


def engine_config(engine_args: Mapping[str, Any]) -> Any:
    """The VllmConfig V1's engine builds from the model's engine arguments (no engine started)."""
    return EngineArgs(**engine_args).create_engine_config()


class TritonV1EngineClient(TritonModelState, EngineClient):
    """vLLM 0.32's EngineClient over one Triton model; `adapters` maps the names its LoRA adapters are
    served under to their names in its multi_lora.json."""

    def __init__(
        self,
        client: Any,
        model_name: str,
        vllm_config: Any,
        adapters: Mapping[str, str],
        tap: OutputTap | None = None,
    ) -> None:
        self._streams = ModelStreams(client, model_name)
        self._tap = tap  # where the model's stub sends the data responses, when it can (output_tap.py)
        self.model_name = model_name
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._adapters = dict(adapters)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        # What the model's stub serves of what its V1 engine supports: generation, or an embedding
        # model's "embed" (vLLM's routes follow: /v1/embeddings and the scoring routes built on it).
        return (EMBED,) if self.model_config.runner_type == "pooling" else ("generate",)

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        **_engine_options: Any,  # tracing, sessions, data-parallel ranks, reasoning hints: the engine's own
    ) -> AsyncGenerator[RequestOutput, None]:
        """Checks the request (a ValueError here is vLLM's 400), then returns its stream of outputs."""
        prompt_ids = tokenized_prompt(prompt)
        if prompt.get("multi_modal_data") or prompt.get("mm_kwargs"):
            raise UnsupportedRequest(
                "images are not served to vllm_engine 'v1' models through the OpenAI API "
                "(on GPU hosts the model's KServe 'image' input takes them)"
            )
        lora_name = self._adapters.get(lora_request.lora_name) if lora_request is not None else None
        request = triton_requests.triton_request(prompt_ids, sampling_params, lora_name, priority)
        text = prompt_text if prompt_text is not None else prompt.get("prompt")
        return self._stream(request_id, prompt_ids, request, sampling_params, text)

    async def _stream(
        self, request_id: str, prompt_ids: list[int], request: Any, params: SamplingParams, prompt_text: str | None
    ) -> AsyncGenerator[RequestOutput, None]:
        streamed = params.output_kind == RequestOutputKind.DELTA
        first = streamed  # streamed answers echo the prompt's text
        finish_sent: set[int] = set()
        async with aclosing(self._streams.responses(request_id, request, self._tap)) as responses:
            async for values in responses:
                if NUM_OUTPUT_TOKENS in values:  # a data response (the empty FINAL has none)
                    output = triton_requests.request_output(request_id, prompt_ids, values, params.n)
                    if streamed and params.n > 1:
                        # The model answers all n each step; V1's own engine streams only those with
                        # something new (tokens, or their finish once), and its serving code chunks so.
                        output.outputs = new_parts(output.outputs, finish_sent)
                        if not output.outputs and not output.finished:
                            continue
                    if first:
                        output.prompt = prompt_text
                        first = False
                    yield output

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        **_engine_options: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """An embedding model's request (vLLM 0.32's pooling serving code, its parameters verified against
        the model): one vector for a tokenized prompt. What `embedding_request` cannot carry (another
        pooling task, `use_activation` other than the model's own) is refused by name, never dropped."""
        prompt_ids = tokenized_prompt(prompt, lora_request, embedding=True)
        if pooling_params.task != EMBED:
            raise UnsupportedRequest(f"pooling task {pooling_params.task!r} is not served (this API serves 'embed')")
        models_own = PoolingParams(task=EMBED)
        models_own.verify(self.model_config)
        if pooling_params.use_activation != models_own.use_activation:
            raise UnsupportedRequest(
                f"use_activation {pooling_params.use_activation!r} is not served through this API "
                f"(the model's own: {models_own.use_activation!r})"
            )
        return self._pooled(request_id, prompt_ids, pooling_params.dimensions, priority)

    async def _pooled(
        self, request_id: str, prompt_ids: list[int], dimensions: int | None, priority: int
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        import torch

        async with aclosing(self._streams.embeddings(request_id, prompt_ids, dimensions, priority)) as vectors:
            async for values in vectors:
                vector = torch.tensor(values, dtype=torch.float32)
                yield PoolingRequestOutput(request_id, PoolingOutput(vector), prompt_ids, 0, True)

    async def check_health(self) -> None:
        try:
            await self._streams.check_health()
        except EngineUnavailable as error:
            # vLLM 0.32's /health answers 503 for its EngineDeadError only (anything else: a 500).
            raise EngineDeadError(str(error)) from error

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        if lora_request.lora_name not in self._adapters:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} is not in model {self.model_name}'s multi_lora.json"
            )
        return True

    async def abort(self, request_id: str | Iterable[str]) -> None:
        return None  # a request is aborted by cancelling its gRPC stream (see _stream)

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None  # the model's metrics are Triton's (its metrics port)

    # Engine control that belongs to the Triton model, not to this server.
    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("profiling runs in the Triton model")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling runs in the Triton model")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        raise NotImplementedError("the prefix cache belongs to the Triton model")

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("sleep mode is not served")

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("the KV cache belongs to the Triton model")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        raise NotImplementedError("sleep mode is not served")

    async def is_sleeping(self) -> bool:
        return False

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("pausing belongs to the Triton model (drain it: docs/lifecycle.md)")

    async def resume_generation(self) -> None:
        raise NotImplementedError("pausing belongs to the Triton model (drain it: docs/lifecycle.md)")

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        return None  # the engine is the Triton model's
