"""The OpenAI server of one `vllm_engine: v1` model: vLLM 0.32's own app over the Triton model.

Owns the process's life under `.venv-v1`'s Python: vLLM 0.32's `serve` arguments (and ours: the
model, its engine arguments and adapters as the multi-step models' server read them from its
settings), the engine client, then vLLM's own app and HTTP server until SIGTERM. Started by the
multi-step models' server (frontend/v1_servers.py) on a local port, which routes each request naming
this model to it (frontend/router.py): one OpenAI port for the models of both engines.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import signal
import sys
from typing import Any

from triton_vllm_multistep.logs import log_server_to_stderr

PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def parse_args(argv: list[str]) -> argparse.Namespace:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m triton_vllm_multistep.frontend_v1"))
    ours = parser.add_argument_group("Triton")
    ours.add_argument("--grpc-url", required=True, help="tritonserver's gRPC endpoint")
    ours.add_argument("--triton-model", required=True, help="the vllm_engine 'v1' Triton model served")
    ours.add_argument(
        "--engine-args", required=True, help="the model's engine arguments (JSON), as its stub reads them"
    )
    ours.add_argument(
        "--adapters", default="{}", help="JSON: each LoRA adapter's served name → its multi_lora.json name"
    )
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    args.disable_log_stats = True  # the model's statistics are Triton's (its metrics port)
    return args


async def serve(args: argparse.Namespace) -> None:
    import tritonclient.grpc.aio as grpcclient
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve
    from vllm.entrypoints.launchers.launcher import setup_server

    from triton_vllm_multistep.frontend.tap_listener import OutputTap, tap_wanted
    from triton_vllm_multistep.frontend_v1.engine_client import TritonV1EngineClient, engine_config

    client = grpcclient.InferenceServerClient(args.grpc_url)
    # The model's stub writes this server's requests' data responses to its tap when it can reach it
    # (the same host), otherwise sends them through Triton: either way they are read.
    tap = OutputTap()
    try:
        if tap_wanted():
            await tap.start()
        engine_args: dict[str, Any] = json.loads(args.engine_args)
        engine_client = TritonV1EngineClient(
            client, args.triton_model, engine_config(engine_args), json.loads(args.adapters), tap
        )
        listen_address, sock = setup_server(args, reuse_port=False)
        try:
            shutdown = await build_and_serve(engine_client, listen_address, sock, args)
            await shutdown
        finally:
            sock.close()
    finally:
        await tap.close()
        await client.close()


def die_with_parent() -> None:
    """SIGTERM this process when the server that started it exits, however it exits (Linux's parent
    death signal): uvicorn ends that server by raising the SIGTERM it caught once its requests are
    done, so no code of it runs after to stop this one."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the launcher's kill of the process group remains
        pass


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    log_server_to_stderr()  # this project's lines as the multi-step models' server logs them
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        asyncio.run(serve(args))
    except Exception as error:
        why = f"{type(error).__name__}: {error}"
        print(f"[triton-vllm-multistep] the OpenAI server of {args.triton_model} stopped: {why}", file=sys.stderr)
        return 1
    return 0
