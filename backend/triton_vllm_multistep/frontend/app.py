"""The FastAPI app: vLLM 0.8.5's OpenAI routes over one serving set per Triton model.

Owns building vLLM's app (`build_app`: routes, validation errors, API key, CORS) and its state
without a vLLM engine: for each model, vLLM's OpenAIServingModels / Chat / Completion /
Tokenization (an embedding model: Embedding instead of Chat / Completion) on that model's
TritonEngineClient (what `init_app_state` builds for one engine),
and small dispatchers that hand each request to the set of the model it names.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.logger import RequestLogger
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.protocol import ErrorResponse, ModelList
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from vllm.entrypoints.openai.serving_models import BaseModelPath, LoRAModulePath, OpenAIServingModels
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

from triton_vllm_multistep.frontend.engine_client import TritonEngineClient
from triton_vllm_multistep.frontend.errors import EngineUnavailable


@dataclass(frozen=True)
class ServedModel:
    """One Triton LLM model as the OpenAI server serves it."""

    engine_client: TritonEngineClient
    model_path: str  # what /v1/models reports as its root (the model's folder)
    lora_modules: tuple[LoRAModulePath, ...] = ()


@dataclass
class ServingSet:
    """vLLM's serving objects for one model: chat and completions for a generative model, embeddings
    for an embedding model (None: the model does not serve that API)."""

    models: OpenAIServingModels
    tokenization: OpenAIServingTokenization
    chat: OpenAIServingChat | None = None
    completion: OpenAIServingCompletion | None = None
    embedding: OpenAIServingEmbedding | None = None


# What vLLM's routes answer when the server has no handler for an API: per model here, with its name.
API_NAMES = {"chat": "Chat Completions API", "completion": "Completions API", "embedding": "Embeddings API"}


class ByModel:
    """Hands each call to the serving object of the model its request names (vLLM's route
    functions call `handler.method(request, raw_request)`); a request naming no model, or one not
    served, goes to the first model's, whose own check answers 404 for an unknown name; one naming a
    model without this API (None) gets vLLM's 400 for it."""

    def __init__(self, by_name: dict[str, Any], first: Any, api: str) -> None:
        self._by_name = by_name
        self._first = first
        self._api = api

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not args:  # not a request's call (vLLM's routes build errors with `create_error_response(message=...)`)
                return getattr(self._first, name)(**kwargs)
            request = args[0]
            model = getattr(request, "model", None) or ""
            target = self._by_name.get(model, self._first if hasattr(self._first, name) else None)
            if target is None:
                return self._unsupported(model)
            return getattr(target, name)(*args, **kwargs)

        return call

    async def _unsupported(self, model: str) -> ErrorResponse:
        return self._first.create_error_response(message=f"The model does not support {self._api} (model {model!r})")


class AllModels:
    """`/v1/models`: every served model and adapter, across the serving sets."""

    def __init__(self, sets: Sequence[ServingSet]) -> None:
        self._sets = sets

    async def show_available_models(self) -> ModelList:
        cards = []
        for serving in self._sets:
            cards.extend((await serving.models.show_available_models()).data)
        return ModelList(data=cards)


class AllEngines:
    """`/health`: 200 only while every served Triton model is ready."""

    def __init__(self, clients: Sequence[TritonEngineClient]) -> None:
        self._clients = clients

    async def check_health(self) -> None:
        for client in self._clients:
            await client.check_health()


async def build_serving_set(served: ServedModel, args: argparse.Namespace) -> ServingSet:
    client = served.engine_client
    model_config = await client.get_model_config()
    request_logger = None if args.disable_log_requests else RequestLogger(max_log_len=args.max_log_len)
    models = OpenAIServingModels(
        engine_client=client,
        model_config=model_config,
        base_model_paths=[BaseModelPath(name=client.model_name, model_path=served.model_path)],
        lora_modules=list(served.lora_modules) or None,
        prompt_adapters=None,
    )
    await models.init_static_loras()
    chat_template = load_chat_template(args.chat_template)
    # What vLLM's tokenization and embedding serving take beside the model's objects.
    templated = {
        "request_logger": request_logger,
        "chat_template": chat_template,
        "chat_template_content_format": args.chat_template_content_format,
    }
    tokenization = OpenAIServingTokenization(client, model_config, models, **templated)
    if model_config.task == "embed":
        embedding = OpenAIServingEmbedding(client, model_config, models, **templated)
        return ServingSet(models=models, tokenization=tokenization, embedding=embedding)
    return ServingSet(
        models=models,
        tokenization=tokenization,
        chat=OpenAIServingChat(
            client,
            model_config,
            models,
            args.response_role,
            request_logger=request_logger,
            chat_template=chat_template,
            chat_template_content_format=args.chat_template_content_format,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_auto_tools=args.enable_auto_tool_choice,
            tool_parser=args.tool_call_parser,
            enable_reasoning=args.enable_reasoning,
            reasoning_parser=args.reasoning_parser,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        ),
        completion=OpenAIServingCompletion(
            client,
            model_config,
            models,
            request_logger=request_logger,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        ),
    )


async def build_openai_app(served_models: Sequence[ServedModel], args: argparse.Namespace) -> FastAPI:
    """vLLM's app with its state for `served_models` (args: vLLM's `serve` options)."""
    if not served_models:
        raise ValueError("no LLM model to serve")
    args.disable_log_stats = True  # the models' statistics are Triton's (its metrics port)
    app = build_app(args)
    sets = [await build_serving_set(served, args) for served in served_models]
    by_name: dict[str, ServingSet] = {}
    for served, serving in zip(served_models, sets, strict=True):
        for name in [served.engine_client.model_name, *(m.name for m in served.lora_modules)]:
            if name in by_name:
                raise ValueError(f"two served models are named {name!r} (a Triton model or a LoRA adapter)")
            by_name[name] = serving

    def dispatch(part: str) -> ByModel:
        """The part's dispatcher; where no model has it, its errors come from the first model's
        tokenization (vLLM's own route would answer such a request 200 with an error body)."""
        handlers = {name: getattr(s, part) for name, s in by_name.items()}
        present = [handler for handler in handlers.values() if handler is not None]
        return ByModel(handlers, present[0] if present else sets[0].tokenization, API_NAMES.get(part, part))

    state = app.state
    state.engine_client = AllEngines([served.engine_client for served in served_models])
    state.log_stats = False
    state.vllm_config = await served_models[0].engine_client.get_vllm_config()
    state.openai_serving_models = AllModels(sets)
    state.openai_serving_chat = dispatch("chat")
    state.openai_serving_completion = dispatch("completion")
    state.openai_serving_tokenization = dispatch("tokenization")
    state.openai_serving_embedding = dispatch("embedding")
    for unsupported in (
        "openai_serving_pooling",
        "openai_serving_scores",
        "jinaai_serving_reranking",
        "openai_serving_transcription",
    ):
        setattr(state, unsupported, None)  # vLLM's routes answer "the model does not support ..."
    # The task vLLM's /invocations routes by: generation if any model generates.
    state.task = "generate" if any(s.chat is not None for s in sets) else "embed"
    state.enable_server_load_tracking = args.enable_server_load_tracking
    state.server_load_metrics = 0

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, error: EngineUnavailable) -> JSONResponse:
        body = ErrorResponse(message=str(error), type="ServiceUnavailableError", code=HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(body.model_dump(), status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    return app
