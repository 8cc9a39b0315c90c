"""The FastAPI app: vLLM 0.8.5's OpenAI routes over one serving set per Triton model.

Owns building vLLM's app (`build_app`: routes, validation errors, API key, CORS) and its state
without a vLLM engine: for each model, vLLM's OpenAIServingModels / Chat / Completion /
Tokenization on that model's TritonEngineClient (what `init_app_state` builds for one engine),
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
    models: OpenAIServingModels
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    tokenization: OpenAIServingTokenization


class ByModel:
    """Hands each call to the serving object of the model its request names (vLLM's route
    functions call `handler.method(request, raw_request)`); a request naming no model, or one not
    served, goes to the first model's, whose own check answers 404 for an unknown name."""

    def __init__(self, by_name: dict[str, Any], first: Any) -> None:
        self._by_name = by_name
        self._first = first

    def __getattr__(self, name: str) -> Any:
        def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            target = self._by_name.get(getattr(request, "model", None) or "", self._first)
            return getattr(target, name)(request, *args, **kwargs)

        return call


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
    return ServingSet(
        models=models,
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
        tokenization=OpenAIServingTokenization(
            client,
            model_config,
            models,
            request_logger=request_logger,
            chat_template=chat_template,
            chat_template_content_format=args.chat_template_content_format,
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
        return ByModel({name: getattr(s, part) for name, s in by_name.items()}, getattr(sets[0], part))

    state = app.state
    state.engine_client = AllEngines([served.engine_client for served in served_models])
    state.log_stats = False
    state.vllm_config = await served_models[0].engine_client.get_vllm_config()
    state.openai_serving_models = AllModels(sets)
    state.openai_serving_chat = dispatch("chat")
    state.openai_serving_completion = dispatch("completion")
    state.openai_serving_tokenization = dispatch("tokenization")
    for unsupported in (
        "openai_serving_pooling",
        "openai_serving_embedding",
        "openai_serving_scores",
        "jinaai_serving_reranking",
        "openai_serving_transcription",
    ):
        setattr(state, unsupported, None)  # vLLM's routes answer "the model does not support ..."
    state.task = "generate"
    state.enable_server_load_tracking = args.enable_server_load_tracking
    state.server_load_metrics = 0

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, error: EngineUnavailable) -> JSONResponse:
        body = ErrorResponse(message=str(error), type="ServiceUnavailableError", code=HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(body.model_dump(), status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    return app
