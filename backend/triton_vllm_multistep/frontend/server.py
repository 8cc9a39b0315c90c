"""The OpenAI server process: finds the repository's LLM models in Triton, then serves them.

Owns the process's life: wait for tritonserver to be live (over gRPC), read each loaded
`vllm_multistep` model's settings (settings/, as its stub does); build each multi-step model's
ModelConfig, tokenizer and LoRA adapters for vLLM 0.8.5's app, and start each `vllm_engine: v1` model's
own server (frontend/v1_servers.py: vLLM 0.32's app in the V1 environment), routed to on this port
(frontend/router.py); then serve under uvicorn until SIGTERM (uvicorn stops accepting, lets requests
in flight finish, then exits; the V1 models' servers are stopped after it). Started by `serve --openai-port`
(host/launcher.py), or on its own beside any tritonserver: `python -m triton_vllm_multistep.frontend`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from triton_vllm_multistep.frontend import v1_servers
from triton_vllm_multistep.frontend.tap_listener import OutputTap, tap_wanted
from triton_vllm_multistep.logs import SERVER_LOG_FORMAT
from triton_vllm_multistep.settings import ModelSettings, read_model_settings

BACKEND_NAME = "vllm_multistep"
# asyncio's own loop, which grpc.aio supports; "uvloop" in this variable runs vllm serve's loop
# instead (0-25% less CPU per streamed token here, but a model was seen not to unload at server
# stop in a run with it: docs/openai.md).
LOOP_ENV = "TRITON_VLLM_MULTISTEP_OPENAI_LOOP"
READY_TIMEOUT_SECONDS = 3600.0  # model loads can be long; the launcher stops this process with the server

logger = logging.getLogger("triton_vllm_multistep.frontend")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m triton_vllm_multistep.frontend"))
    ours = parser.add_argument_group("Triton")
    ours.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC endpoint")
    ours.add_argument(
        "--model-repository",
        action="append",
        default=[],
        required=True,
        help="tritonserver's --model-repository (each); the models' model.json is read from it",
    )
    ours.add_argument(
        "--triton-model",
        action="append",
        default=[],
        help="serve only these Triton models (default: every loaded vllm_multistep model)",
    )
    ours.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_SECONDS)
    ours.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds for requests in flight at SIGTERM")
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # passed on to the V1 models' servers
    return args


async def wait_for_server(client: Any, timeout: float) -> None:
    """Until tritonserver answers as live: it opens its endpoints once its start-up loads are done.
    Not its readiness: under strict readiness (the default) one model that failed to load keeps the
    whole server unready, while the loaded models are served."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await client.is_server_live():
                return
        except Exception:  # not listening yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"tritonserver not live within {timeout:g} s")
        await asyncio.sleep(0.5)


async def discover(client: Any, repositories: list[Path], only: list[str]) -> list[tuple[str, str, dict, Path]]:
    """(name, version, loaded config, model folder) of each loaded vllm_multistep model."""
    index = await client.get_model_repository_index(as_json=True)
    found = []
    for entry in index.get("models", []):
        name, version = entry["name"], entry.get("version", "")
        if entry.get("state") != "READY" or (only and name not in only):
            continue
        loaded = (await client.get_model_config(name, as_json=True))["config"]
        if loaded.get("backend") != BACKEND_NAME:
            continue
        folder = next((r / name for r in repositories if (r / name).is_dir()), None)
        if folder is None:
            raise RuntimeError(f"model {name} is loaded but none of {', '.join(map(str, repositories))} holds it")
        found.append((name, version or "1", loaded, folder))
    missing = sorted(set(only) - {name for name, *_ in found})
    if missing:
        raise RuntimeError(f"--triton-model {', '.join(missing)}: not a loaded {BACKEND_NAME} model")
    return found


LORA_SEPARATOR = "_lora_"  # Triton's OpenAI frontend's default --lora-separator


def adapter_model_names(adapters: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """For each Triton model (name → its multi_lora.json adapter names): served name → adapter name.

    Every adapter is served as `<model>_lora_<adapter>` (Triton's OpenAI frontend's names), and
    by its own name too where that names one thing only (no other model's adapter, no model).
    """
    counts: dict[str, int] = {}
    for names in adapters.values():
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    served: dict[str, dict[str, str]] = {}
    for model, names in adapters.items():
        served[model] = {f"{model}{LORA_SEPARATOR}{name}": name for name in names}
        for name in names:
            if counts[name] == 1 and name not in adapters:
                served[model][name] = name
    return served


def model_settings(settings: ModelSettings) -> tuple[Any, Any]:
    """(ModelConfig, tokenizer) of a multi-step model, from its settings as its stub reads them
    (settings/, engine/engine_args.py)."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    from triton_vllm_multistep.engine.engine_args import engine_args_of

    model_config = engine_args_of(settings).create_model_config()
    tokenizer = get_tokenizer(
        model_config.tokenizer,
        tokenizer_mode=model_config.tokenizer_mode,
        trust_remote_code=model_config.trust_remote_code,
        revision=model_config.tokenizer_revision,
    )
    return model_config, tokenizer


def on_v1(settings: ModelSettings) -> bool:
    """A `vllm_engine: v1` model: served by a server of its own under the V1 environment's vLLM (its
    tokenizer and chat template are that environment's: frontend/v1_servers.py)."""
    return settings.backend.vllm_engine == "v1"


def served_models(
    client: Any,
    models: dict[str, ModelSettings],
    adapter_names: dict[str, dict[str, str]],
    tap: OutputTap | None = None,
) -> list[Any]:
    """The multi-step models as vLLM 0.8.5's app serves them; `adapter_names`: adapter_model_names';
    `tap`: this server's output tap (frontend/tap_listener.py), when started."""
    from vllm.entrypoints.openai.serving_models import LoRAModulePath

    from triton_vllm_multistep.frontend.app import ServedModel
    from triton_vllm_multistep.frontend.engine_client import TritonEngineClient

    served = []
    for name, settings in models.items():
        model_config, tokenizer = model_settings(settings)
        paths = {a.name: a.path for a in settings.adapters or ()}
        engine_client = TritonEngineClient(client, name, model_config, tokenizer, adapter_names[name], tap)
        lora_modules = tuple(
            LoRAModulePath(served_name, paths[adapter], base_model_name=name)
            for served_name, adapter in adapter_names[name].items()
        )
        served.append(ServedModel(engine_client, model_config.model, lora_modules))
    return served


async def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from tritonclient.grpc import aio as grpcclient
    from vllm.entrypoints.openai.api_server import TIMEOUT_KEEP_ALIVE

    from triton_vllm_multistep.frontend.app import build_openai_app
    from triton_vllm_multistep.frontend.router import ModelRouter

    client = grpcclient.InferenceServerClient(args.grpc_url)
    v1: list[v1_servers.V1Server] = []  # the V1 models' own servers, routed to
    tap = OutputTap()  # the multi-step models' stubs write this server's data responses there
    try:
        await wait_for_server(client, args.ready_timeout)
        models = await discover(client, [Path(r) for r in args.model_repository], args.triton_model)
        if not models:
            raise RuntimeError(f"tritonserver has no loaded {BACKEND_NAME} model to serve")
        settings = {name: read_model_settings(folder, version, loaded) for name, version, loaded, folder in models}
        adapter_names = adapter_model_names({name: [a.name for a in s.adapters or ()] for name, s in settings.items()})
        multistep = {name: s for name, s in settings.items() if not on_v1(s)}
        on_v1_models = [name for name, s in settings.items() if on_v1(s)]
        # One V1 model alone: its server takes this API's address itself (no routing hop per chunk).
        alone = (args.host or "0.0.0.0", args.port) if not multistep and len(on_v1_models) == 1 else None
        for name in on_v1_models:
            v1.append(v1_servers.start(args.argv, args.grpc_url, settings[name], adapter_names[name], alone))
        for v1_server in v1:
            await v1_servers.wait_healthy(v1_server, args.ready_timeout)
        names = ", ".join(settings)
        announcement = f"[triton-vllm-multistep] OpenAI-compatible API on port {args.port}: {names}"
        if alone is not None:
            print(announcement, file=sys.stderr, flush=True)
            await v1_servers.run_in_front(v1[0])
            return
        if multistep and tap_wanted():
            await tap.start()
        app = await build_openai_app(served_models(client, multistep, adapter_names, tap), args) if multistep else None
        routed = {served: v1_server.url for v1_server in v1 for served in v1_server.served_names}
        config = uvicorn.Config(
            ModelRouter(app, routed) if v1 else app,
            host=args.host or "0.0.0.0",
            port=args.port,
            loop="none",  # this process's own loop (see main)
            log_level=args.uvicorn_log_level,
            timeout_keep_alive=TIMEOUT_KEEP_ALIVE,  # vllm serve's
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        server = uvicorn.Server(config)
        logger.info("OpenAI-compatible API for %s on port %d", names, args.port)
        print(announcement, file=sys.stderr, flush=True)
        await server.serve()
    finally:
        v1_servers.stop_all(v1, args.shutdown_timeout)
        await tap.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=SERVER_LOG_FORMAT)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if os.environ.get(LOOP_ENV, "asyncio") == "uvloop" and importlib.util.find_spec("uvloop") is not None:
            import uvloop

            uvloop.run(serve(args))  # vllm serve's loop
        else:
            asyncio.run(serve(args))
    except Exception as error:
        print(f"[triton-vllm-multistep] the OpenAI server stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0
