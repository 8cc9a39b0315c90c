"""The OpenAI servers of the `vllm_engine: v1` models: started beside this one, one per model.

Owns their lives: each V1 model's server (frontend_v1/, vLLM 0.32's app) runs under the V1
environment's Python (TRITON_VLLM_MULTISTEP_V1_PYTHON, which the launcher and the image set, else the
.venv-v1 beside this environment) on a local port, with this server's vLLM `serve` options and the
model's engine arguments and adapters as its settings give them; this server waits for each to be
healthy, routes to them (frontend/router.py), or, when one V1 model is all the API serves, lets its
server take the API's own address (no routing hop) and passes it the signals to stop. Each ends when
this server does (it asks for its parent's death signal), or when this server stops them after an
error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from triton_vllm_multistep.lifecycle import triton_command
from triton_vllm_multistep.settings import ModelSettings
from triton_vllm_multistep.settings.v1_environment import configured_v1_python, no_v1_environment, v1_environment

logger = logging.getLogger("triton_vllm_multistep.frontend")

V1_FRONTEND_MODULE = "triton_vllm_multistep.frontend_v1"
# This server's own options (and vLLM's it sets per model): not passed on to a V1 model's server.
NOT_PASSED = frozenset(
    {
        "--grpc-url",
        "--model-repository",
        "--triton-model",
        "--ready-timeout",
        "--shutdown-timeout",
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--lora-modules",
    }
)


class V1ServerError(RuntimeError):
    """A V1 model's OpenAI server could not start; the message names the model and why."""


@dataclass
class V1Server:
    """One V1 model's OpenAI server process."""

    model: str
    url: str
    process: subprocess.Popen
    served_names: tuple[str, ...]  # the model and its adapters, as requests name them


def passed_options(argv: Sequence[str]) -> list[str]:
    """This server's argv without its own options (`--name value` or `--name=value` forms)."""
    passed, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, equals, _ = arg.partition("=")
        if name in NOT_PASSED:
            skip = not equals
            continue
        passed.append(arg)
    return passed


def server_argv(
    python: str,
    argv: Sequence[str],
    grpc_url: str,
    settings: ModelSettings,
    adapters: Mapping[str, str],
    port: int,
    host: str = "127.0.0.1",
) -> list[str]:
    """The argv of `settings`' model's server: `adapters` maps each served adapter name to its
    multi_lora.json name."""
    paths = {adapter.name: adapter.path for adapter in settings.adapters or ()}
    command = [
        python,
        "-m",
        V1_FRONTEND_MODULE,
        f"--grpc-url={grpc_url}",
        f"--triton-model={settings.name}",
        f"--engine-args={json.dumps(dict(settings.engine_args))}",
        f"--adapters={json.dumps(dict(adapters))}",
        f"--model={settings.engine_args['model']}",
        f"--served-model-name={settings.name}",
        f"--host={host}",
        f"--port={port}",
    ]
    if adapters:
        command += ["--lora-modules", *(f"{served}={paths[name]}" for served, name in adapters.items())]
    return [*command, *passed_options(argv)]


def v1_python() -> str:
    python = configured_v1_python()
    if python is None:
        raise V1ServerError(no_v1_environment("a vllm_engine 'v1' model's OpenAI server"))
    return python


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(
    argv: Sequence[str],
    grpc_url: str,
    settings: ModelSettings,
    adapters: Mapping[str, str],
    address: tuple[str, int] | None = None,
) -> V1Server:
    """The model's server on a local port, or on `address` (host, port) when it is the API alone."""
    host, port = address if address is not None else ("127.0.0.1", free_port())
    command = server_argv(v1_python(), argv, grpc_url, settings, adapters, port, host)
    logger.info("starting the OpenAI server of V1 model %s on %s:%d", settings.name, host, port)
    # In this process's group: the launcher's kill of it reaches them too.
    process = subprocess.Popen(command, env=v1_environment(os.environ), stdin=subprocess.DEVNULL)
    local = triton_command.local_address(host)
    url = f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"
    return V1Server(settings.name, url, process, (settings.name, *adapters))


async def run_in_front(server: V1Server) -> None:
    """Until the server on the API's address exits: SIGTERM and SIGINT passed on to it (it stops
    accepting and lets its requests in flight finish); its failure raised."""
    loop = asyncio.get_running_loop()
    asked = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: (asked.append(True), server.process.send_signal(signal.SIGTERM)))
    code = await asyncio.to_thread(server.process.wait)
    if code != 0 and not asked:
        raise V1ServerError(f"the OpenAI server of V1 model {server.model} exited with code {code} (its log above)")


async def wait_healthy(server: V1Server, timeout: float) -> None:
    """Until its /health answers 200 (its app is up and the Triton model ready); raises when it exits."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            code = server.process.poll()
            if code is not None:
                raise V1ServerError(
                    f"the OpenAI server of V1 model {server.model} exited with code {code} (its log above)"
                )
            try:
                if (await client.get(f"{server.url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if asyncio.get_running_loop().time() > deadline:
                raise V1ServerError(
                    f"the OpenAI server of V1 model {server.model} was not healthy within {timeout:g} s"
                )
            await asyncio.sleep(0.5)


def stop_all(servers: Sequence[V1Server], timeout: float) -> None:
    """SIGTERM each (its requests in flight finish), then kill what is left after `timeout`."""
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
