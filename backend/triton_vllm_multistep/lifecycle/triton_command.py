"""What the running tritonserver was told on its command line: exit timeout, HTTP endpoint, model control.

Owns parsing a tritonserver argv (getopt_long style: `--name=value` or `--name value`, the last
one wins) and reading the server's argv (procfs); must not start or talk to the server.
A model instance's stub process is a child of tritonserver, so the stub reads its parent's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from triton_vllm_multistep.lifecycle import procfs
from triton_vllm_multistep.lifecycle.protocol import TRITON_DEFAULT_EXIT_TIMEOUT

TRITON_DEFAULT_HTTP_PORT = 8000
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


@dataclass(frozen=True)
class TritonCommand:
    exit_timeout: float | None  # None: the value given is not a number
    http_endpoint: tuple[str, int] | None  # where a local client reaches the HTTP frontend; None: off
    model_control_mode: str  # "none", "poll" or "explicit"


def option_values(argv: Sequence[str], name: str) -> list[str]:
    """Every value given for option `name` (`--name=value` or `--name value`), in order."""
    values = []
    for index, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            values.append(arg.split("=", 1)[1])
        elif arg == name and index + 1 < len(argv):
            values.append(argv[index + 1])
    return values


def local_address(address: str) -> str:
    """Where a client on this host reaches a server bound to `address` (an any-address: its loopback)."""
    return _ANY_ADDRESS.get(address, address.strip("[]"))


def _last(argv: Sequence[str], name: str, default: str) -> str:
    values = option_values(argv, name)
    return values[-1] if values else default


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def is_tritonserver(argv: Sequence[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "tritonserver"


def is_python_backend_stub(argv: Sequence[str]) -> bool:
    """A Python backend stub process: where a Python model instance (and this backend's engine) runs."""
    return bool(argv) and "triton_python_backend_stub" in Path(argv[0]).name


def parse(argv: Sequence[str]) -> TritonCommand | None:
    """The settings of a tritonserver command line (Triton's defaults where absent); None if not tritonserver."""
    if not is_tritonserver(argv):
        return None
    endpoint = None
    if _last(argv, "--allow-http", "true").strip().lower() not in ("false", "0", "no", "off"):
        address = _last(argv, "--http-address", "0.0.0.0")
        port = _as_float(_last(argv, "--http-port", str(TRITON_DEFAULT_HTTP_PORT)))
        if port is not None and port == int(port) and 0 < port < 65536:
            endpoint = (local_address(address), int(port))
    return TritonCommand(
        exit_timeout=_as_float(_last(argv, "--exit-timeout-secs", str(TRITON_DEFAULT_EXIT_TIMEOUT))),
        http_endpoint=endpoint,
        model_control_mode=_last(argv, "--model-control-mode", "none").strip().lower(),
    )


def exit_timeout_of(command: TritonCommand | None) -> float:
    """The server's exit timeout; Triton's default when its command line does not say (or is unknown)."""
    if command is None or command.exit_timeout is None:
        return TRITON_DEFAULT_EXIT_TIMEOUT
    return command.exit_timeout


def of_process(pid: int) -> TritonCommand | None:
    """The settings of tritonserver process `pid`; None if it is not tritonserver (or is gone)."""
    return parse(procfs.cmdline(pid))
