"""A real tritonserver started through the project's launcher on free local ports.

For tests, benchmarks and scripts. Owns copying a model folder with changed settings, ports,
readiness polling (with a restart when a start stalls or loses its ports), the server's process
tree (found through lifecycle.procfs, handed out as psutil processes for measuring) and clean
shutdown; knows nothing about what the models do. Needs psutil and requests (test extra).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.host import openai_process
from triton_vllm_multistep.lifecycle import procfs, triton_command
from triton_vllm_multistep.stubguard.guard import ENTRY_MODULE as stubguard_entry

# The launcher's exit status for a tritonserver killed by signal N is 128 + N (host/launcher.py).
SIGNAL_EXIT = 128


def copy_model(
    source: Path, target: Path, engine: dict[str, Any] | None = None, parameters: dict[str, str] | None = None
) -> Path:
    """Copy a model folder of this backend, overriding model.json fields and config.pbtxt parameters.

    `parameters` replace the same key's line in config.pbtxt and configs/*.pbtxt, or are added; an
    `engine` field set to None is removed from model.json.
    """
    shutil.copytree(source, target)
    engine_path = target / "1" / "model.json"
    fields = json.loads(engine_path.read_text()) | (engine or {})
    engine_path.write_text(json.dumps({key: value for key, value in fields.items() if value is not None}, indent=1))
    for config in (target / "config.pbtxt", *sorted((target / "configs").glob("*.pbtxt"))):
        text = config.read_text()
        for key, value in (parameters or {}).items():
            # json.dumps quotes and escapes as protobuf's text format reads it (values may hold JSON).
            line = f'parameters {{ key: "{key}" value: {{ string_value: {json.dumps(value)} }} }}\n'
            text, replaced = re.subn(rf'^parameters \{{ key: "{key}" .*$\n', line, text, flags=re.M)
            if not replaced:
                text += line
        config.write_text(text)
    return target


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_CHOSEN_PORT = 15000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (bind to 0, outgoing connections)."""
    try:
        low, high = (int(field) for field in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


# The OS's randomness, not the random module's global generator: an in-process vLLM engine seeds that
# (its `seed`, 0 by default), and two pytest workers that had each built one chose the same three
# ports for their next servers; gRPC's SO_REUSEPORT let both bind them, and one server's requests went
# to the other (seen in a fresh-clone run).
_PORT_CHOICE = random.SystemRandom()


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now and outside the kernel's ephemeral range.

    Why outside: tritonserver binds its ports only after its models have loaded, and while they
    load each vLLM engine takes an ephemeral port of its own (its torch.distributed store, through
    `vllm.utils.get_open_port`) and opens connections from others; a port the kernel itself had
    handed out earlier was taken that way in CI ("Address already in use" after a 50 s load).
    """
    low, high = ephemeral_port_range()
    candidates = list(range(LOWEST_CHOSEN_PORT, low)) if low - LOWEST_CHOSEN_PORT >= 1000 else []
    candidates += range(high + 1, 65536)
    ports: list[int] = []
    for port in _PORT_CHOICE.sample(candidates, len(candidates)):
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports outside the ephemeral range {low}-{high}")


@dataclass
class ServerProcess:
    """A launcher process (and through it tritonserver) with its ports and log."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    openai_port: int | None = None  # the launcher's --openai-port, when given

    @property
    def openai_url(self) -> str:
        """The OpenAI-compatible API's base URL (without /v1)."""
        if self.openai_port is None:
            raise RuntimeError("this server was started without --openai-port")
        return f"http://127.0.0.1:{self.openai_port}"

    def wait_openai_ready(self, timeout: float = 300.0) -> float:
        """Seconds until the OpenAI API answers /health with 200; raises with the log tail if the
        server exits or it never does."""
        import requests

        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.openai_url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the OpenAI API not ready within {timeout} s:\n{self.log_tail()}")

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 60) -> str:
        """The log's error lines (Triton's E-lines, Python tracebacks) and its last lines."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        all_lines = text.splitlines()
        errors = [line for line in all_lines if (line[:1] == "E" and line[1:5].isdigit()) or "Error" in line]
        return "\n".join([*errors[-20:], "...", *all_lines[-lines:]])

    def is_ready(self) -> bool:
        """READY over HTTP and the metrics endpoint answering: tritonserver starts its metrics endpoint
        last, after HTTP, so a test that scrapes right after READY (a restarted server) found it closed."""
        import requests

        try:
            return (
                requests.get(f"{self.http_url}/v2/health/ready", timeout=2).status_code == 200
                and requests.get(self.metrics_url, timeout=2).status_code == 200
            )
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = 300.0, poll: float = 0.25, started: float | None = None) -> float:
        """Seconds until READY (since `started`, a monotonic time, if given); raises with the log
        tail if the server exits or never gets there."""
        started = time.monotonic() if started is None else started
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return time.monotonic() - started
            time.sleep(poll)
        raise TimeoutError(f"server not ready within {timeout} s:\n{self.log_tail()}")

    def descendants(self) -> list[Any]:
        """psutil processes below the launcher: tritonserver and its Python backend stubs."""
        return _as_psutil(procfs.descendants(self.process.pid))

    def running_with(self, argument: str) -> list[Any]:
        """Running processes below the launcher whose command line holds `argument`, as psutil
        processes; zombies and processes gone meanwhile are left out (psutil raises on their
        command lines)."""
        pids = procfs.descendants(self.process.pid)
        return _as_psutil(
            [pid for pid in pids if any(argument in arg for arg in procfs.cmdline(pid)) and procfs.alive(pid)]
        )

    def process_groups(self) -> dict[str, list[Any]]:
        """Live tritonserver, Python backend stub (where the engines run), stub guard and engine processes
        (models with `engine_process: true`, or any other process below the server, e.g. the engine
        process of Triton's vLLM backend), as psutil processes."""
        groups: dict[str, list[int]] = {"tritonserver": [], "stub": [], "engine": [], "guard": []}
        for pid in procfs.descendants(self.process.pid):
            argv = procfs.cmdline(pid)
            if not procfs.alive(pid):
                continue
            if triton_command.is_python_backend_stub(argv):
                if triton_command.is_python_backend_stub(procfs.cmdline(procfs.parent(pid) or 0)):
                    continue  # a stub's child between fork and exec (its guard, its engine) still shows the stub's argv
                groups["stub"].append(pid)
            elif stubguard_entry in argv:
                groups["guard"].append(pid)  # each stub's stall guard (stubguard/)
            elif triton_command.is_tritonserver(argv) or openai_process.FRONTEND_MODULE in argv:
                groups["tritonserver"].append(pid)  # the front ends: KServe and the OpenAI API
            else:
                groups["engine"].append(pid)
        return {kind: _as_psutil(pids) for kind, pids in groups.items()}

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM the launcher (it drains the models, then stops tritonserver); returns its exit code.

        Past `timeout` the launcher and everything it started are killed (tritonserver runs in a
        session of its own, so killing the launcher alone would leave it running).
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                for child in self.descendants():
                    with contextlib.suppress(Exception):
                        child.kill()
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def _as_psutil(pids: list[int]) -> list[Any]:
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # gone meanwhile
            pass
    return processes


def start_server(repository: Path, log_path: Path, *extra_args: str, env: dict | None = None) -> ServerProcess:
    http_port, grpc_port, metrics_port = free_ports(3)
    command = [
        sys.executable,
        "-m",
        "triton_vllm_multistep",
        "serve",
        f"--model-repository={repository}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *extra_args,
    ]
    environment = dict(os.environ)
    environment.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    environment.update(env or {})
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
    openai_ports = [int(a.split("=", 1)[1]) for a in extra_args if a.startswith("--openai-port=")]
    return ServerProcess(process, http_port, grpc_port, metrics_port, log_path, (openai_ports or [None])[-1])


def start_ready_server(
    repository: Path,
    log_path: Path,
    *extra_args: str,
    env: dict | None = None,
    timeout: float = 300.0,
    poll: float = 0.25,
    attempts: int = 2,
) -> tuple[ServerProcess, float]:
    """Start a server and wait until READY; returns it and its seconds from start to READY.

    A start is retried (on new ports, with a log of its own: `<name>-retry<N>.log`) when it stalls
    past `timeout` (a model load was seen to stall once on a heavily loaded host), when a port
    was taken between choosing and binding it (other servers starting on the host meanwhile), or
    when tritonserver died by a signal while its models loaded (Triton 2.51's one-second rule on a
    starved or clock-stepped host, docs/lifecycle.md): that one with a warning carrying the log's
    tail, so the run's summary shows it.
    """
    for attempt in range(attempts):
        log = log_path if attempt == 0 else log_path.with_name(f"{log_path.stem}-retry{attempt}{log_path.suffix}")
        started = time.monotonic()
        server = start_server(repository, log, *extra_args, env=env)
        try:
            return server, server.wait_ready(timeout=timeout, poll=poll, started=started)
        except (TimeoutError, RuntimeError) as error:
            server.stop()
            port_taken = isinstance(error, RuntimeError) and "already in use" in log.read_text(errors="replace")
            crashed = isinstance(error, RuntimeError) and (server.process.returncode or 0) >= SIGNAL_EXIT
            if attempt == attempts - 1 or not (isinstance(error, TimeoutError) or port_taken or crashed):
                raise
            if crashed:
                warnings.warn(
                    f"server died while its models loaded; started again: {error}", RuntimeWarning, stacklevel=2
                )
            print(f"server start failed ({type(error).__name__}); starting again on other ports", flush=True)
    raise AssertionError("unreachable")
