"""Asking a running tritonserver's vllm_multistep model instances to drain before the server is stopped.

Owns finding the server's processes and this backend's stubs (procfs), creating the drain file
and waiting for every instance's "drained" marker; must not signal or stop the server. Used by
the launcher on SIGTERM and by `triton-vllm-multistep drain` (e.g. a Kubernetes preStop hook).
The model side is drain.UnloadDrain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from triton_vllm_multistep.lifecycle import procfs, triton_command
from triton_vllm_multistep.lifecycle.protocol import (
    CLOCK_SLACK_SECONDS,
    DRAIN_FILE_ENV,
    SETTLE_SECONDS,
    drained_marker,
    request_drain,
)


@dataclass(frozen=True)
class DrainResult:
    stubs: list[int]  # this backend's stub processes found in the server
    busy: list[int]  # those that had not marked the drain done (and still ran) when waiting ended
    seconds: float


def _drained(drain_file: Path, pid: int) -> int | None:
    """How many requests the instance in stub `pid` had when it drained, once it has marked it done.

    A marker older than the stub is a leftover (PIDs repeat in containers).
    """
    marker = drained_marker(drain_file, pid)
    try:
        written = marker.stat().st_mtime
        count = int(marker.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    started = procfs.started_at(pid)
    return count if started is None or written >= started - CLOCK_SLACK_SECONDS else None


def tritonserver_pids(drain_file: Path) -> list[int]:
    """The running tritonserver processes whose models watch `drain_file` (from their environment)."""
    return [
        pid
        for pid in procfs.pids()
        if triton_command.of_process(pid) is not None
        and (value := procfs.environment(pid).get(DRAIN_FILE_ENV))
        and Path(value) == drain_file
    ]


def backend_stub_pids(server_pid: int, backend_name: str) -> list[int]:
    """The server's Python-backend stubs that run `backend_name` models (its folder is their last argument)."""
    stubs = []
    for pid in procfs.children(server_pid):
        argv = procfs.cmdline(pid)
        if triton_command.is_python_backend_stub(argv) and argv[-1].endswith(f"/{backend_name}"):
            stubs.append(pid)
    return stubs


def stub_model_name(pid: int) -> str | None:
    """The model a live stub process serves (its argv[1] is <repository>/<model>/<version>/model.py)."""
    argv = procfs.cmdline(pid)
    if not procfs.alive(pid) or len(argv) < 2 or len(Path(argv[1]).parts) < 3:
        return None
    return Path(argv[1]).parts[-3]


def drain_server(
    server_pid: int,
    drain_file: Path,
    backend_name: str,
    timeout: float,
    give_up: Callable[[], bool] = lambda: False,
    settle: float = SETTLE_SECONDS,
) -> DrainResult:
    """Ask the server's instances to drain and wait (up to `timeout` s) until each has (or is gone)."""
    started = time.monotonic()
    stubs = backend_stub_pids(server_pid, backend_name)
    if not stubs:
        return DrainResult([], [], 0.0)
    request_drain(drain_file, server_pid)
    deadline = started + timeout

    def busy() -> list[int]:
        return [pid for pid in stubs if procfs.alive(pid) and _drained(drain_file, pid) is None]

    while (waiting := busy()) and time.monotonic() < deadline and procfs.alive(server_pid) and not give_up():
        time.sleep(0.05)
    if not waiting and any(_drained(drain_file, pid) for pid in stubs):
        time.sleep(settle)  # some instance had streams: let ensembles postprocess their last responses
    return DrainResult(stubs, waiting, time.monotonic() - started)
