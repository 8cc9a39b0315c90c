"""The OpenAI server process beside tritonserver (`serve --openai-port PORT`).

Owns taking the launcher's own `--openai-*` options out of the tritonserver argv, the OpenAI
server's command line (frontend/server.py, run with this Python: it imports vLLM, the launcher
does not) and its lifetime: started with tritonserver (it waits for READY itself, then binds its
port), SIGTERMed first when the server is asked to stop (it stops accepting and lets requests in
flight finish while the models drain), killed after the server exits.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from triton_vllm_multistep.lifecycle import triton_command

TRITON_DEFAULT_GRPC_PORT = 8001
FRONTEND_MODULE = "triton_vllm_multistep.frontend"


class OpenAIOptionError(ValueError):
    """The launcher's --openai-* options cannot work as given; the message says why."""


@dataclass(frozen=True)
class OpenAIOptions:
    port: int
    host: str = "0.0.0.0"
    api_key: str | None = None
    extra: tuple[str, ...] = ()  # vLLM `serve` options for the OpenAI server (--chat-template, ...)


# The launcher's options: name → field. Each takes a value (`--name=value` or `--name value`).
_OPTIONS = {"--openai-port": "port", "--openai-host": "host", "--openai-api-key": "api_key", "--openai-args": "extra"}


def split_options(argv: Sequence[str]) -> tuple[OpenAIOptions | None, list[str]]:
    """(the OpenAI server's options or None when no --openai-port, the argv left for tritonserver)."""
    values: dict[str, str] = {}
    rest: list[str] = []
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        name, equals, value = arg.partition("=")
        if name in _OPTIONS:
            if not equals:
                if index + 1 >= len(args):
                    raise OpenAIOptionError(f"{name} needs a value")
                index += 1
                value = args[index]
            values[_OPTIONS[name]] = value
        else:
            rest.append(arg)
        index += 1
    if "port" not in values:
        if values:
            given = ", ".join(name for name, field in _OPTIONS.items() if field in values)
            raise OpenAIOptionError(f"{given} needs --openai-port")
        return None, rest
    try:
        port = int(values["port"])
    except ValueError:
        raise OpenAIOptionError(f"--openai-port must be a port number, got {values['port']!r}") from None
    if not 0 < port < 65536:
        raise OpenAIOptionError(f"--openai-port must be between 1 and 65535, got {port}")
    return OpenAIOptions(
        port=port,
        host=values.get("host", "0.0.0.0"),
        api_key=values.get("api_key"),
        extra=tuple(shlex.split(values.get("extra", ""))),
    ), rest


def command(options: OpenAIOptions, server_argv: Sequence[str], shutdown_timeout: float) -> list[str]:
    """The OpenAI server's argv for the tritonserver started with `server_argv`."""
    if triton_command.option_values(server_argv, "--allow-grpc")[-1:] in (["false"], ["0"]):
        raise OpenAIOptionError(
            "--openai-port reaches the models over gRPC: it needs tritonserver's gRPC (--allow-grpc)"
        )
    grpc_port = (triton_command.option_values(server_argv, "--grpc-port") or [str(TRITON_DEFAULT_GRPC_PORT)])[-1]
    argv = [
        sys.executable,
        "-m",
        FRONTEND_MODULE,
        f"--grpc-url=127.0.0.1:{grpc_port}",
        f"--host={options.host}",
        f"--port={options.port}",
        f"--shutdown-timeout={shutdown_timeout:g}",
    ]
    argv += [f"--model-repository={r}" for r in triton_command.option_values(server_argv, "--model-repository")]
    if options.api_key:
        argv.append(f"--api-key={options.api_key}")
    return [*argv, *options.extra]


def start(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    # A session of its own, as tritonserver's: a terminal's Ctrl-C reaches the launcher only,
    # which stops this process in its order.
    return subprocess.Popen(list(argv), env=env, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """Ask it to stop (SIGTERM: no new requests, those in flight finish)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)


def kill(process: subprocess.Popen, grace: float = 5.0) -> None:
    """After the server has exited: a moment to finish answering, then killed with its children."""
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
