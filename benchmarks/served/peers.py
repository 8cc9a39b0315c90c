"""The servers users would run instead, on the same engine and model: Triton's vLLM backend and `vllm serve`.

Owns starting them (their model repository or command line, from the same model.json settings as
our served model), finding their processes for CPU accounting and stopping them; must not generate
load (`load`) or judge results (`report`). Both run vLLM 0.8.5 V0 from this environment; on CPU
vLLM has no multi-step, so both run one step per schedule (their default).

Triton's vLLM backend is not part of this project: `--triton-vllm-backend DIR` names a checkout of
its `src/` folder (model.py and utils/; r25.05 is the release users migrate from). Its model.py
needs `pb_utils.get_model_dir()`, which Triton 2.51's Python backend lacks: the entry point written
here supplies it (the model's version folder, where that backend reads model.json) and changes
nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.served.settings import KV_CACHE_GIB, MODEL, engine_json
from triton_vllm_multistep.testing import local_server
from triton_vllm_multistep.testing.local_server import ServerProcess

TRITON_VLLM_BACKEND = "triton_vllm_backend"
VLLM_SERVE = "vllm_serve"
PEER_KINDS = (TRITON_VLLM_BACKEND, VLLM_SERVE)

# backends/vllm/model.py of the peer's backend directory: the upstream model.py, unchanged, with the
# one Python-backend function it needs that Triton 2.51 lacks.
_ENTRY_POINT = '''"""Triton's vLLM backend from {upstream} (written by benchmarks/served/peers.py)."""
import importlib.util
import os
import sys

import triton_python_backend_utils as pb_utils

sys.path.insert(0, {upstream!r})
_spec = importlib.util.spec_from_file_location("triton_vllm_backend_upstream", os.path.join({upstream!r}, "model.py"))
_upstream = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_upstream)


class TritonPythonModel(_upstream.TritonPythonModel):
    def initialize(self, args):
        if not hasattr(pb_utils, "get_model_dir"):
            folder = os.path.join(args["model_repository"], args["model_version"])
            pb_utils.get_model_dir = lambda: folder
        super().initialize(args)
'''

_TRITON_VLLM_CONFIG = """backend: "vllm"
max_batch_size: 0
model_transaction_policy { decoupled: true }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def peer_engine_values(model: str) -> dict[str, Any]:
    """The engine arguments our served model runs (model.json + the CPU config's engine_args) for a
    peer: the model as a folder (peers know no demo:// references), one step per schedule, no
    request or stats logging (as our backend)."""
    from triton_vllm_multistep.demo import models as demo_models

    values = engine_json(1, model)
    values["model"] = demo_models.resolve(values["model"])
    values.pop("num_scheduler_steps")
    values["disable_log_stats"] = True
    return values


def start_triton_vllm_backend(workdir: Path, model: str, upstream: Path, log_path: Path) -> tuple[ServerProcess, float]:
    """A tritonserver (through our launcher, for the same Triton and environment) serving `MODEL` with
    Triton's vLLM backend from `upstream`; returns it and its seconds from start to READY."""
    if not (upstream / "model.py").is_file() or not (upstream / "utils").is_dir():
        raise SystemExit(f"--triton-vllm-backend {upstream}: expected the vllm_backend repository's src/ folder")
    from triton_vllm_multistep.host import launcher

    backends = launcher.prepare_backend_dir(launcher.find_triton(), workdir / "backends")
    (backends / "vllm").mkdir(exist_ok=True)
    (backends / "vllm" / "model.py").write_text(_ENTRY_POINT.format(upstream=str(upstream.resolve())))
    repository = workdir / "repository"
    version = repository / MODEL / "1"
    version.mkdir(parents=True)
    (repository / MODEL / "config.pbtxt").write_text(_TRITON_VLLM_CONFIG)
    (version / "model.json").write_text(json.dumps({**peer_engine_values(model), "disable_log_requests": True}))
    return local_server.start_ready_server(
        repository,
        log_path,
        f"--backend-directory={backends}",
        env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB},
        poll=0.05,
        attempts=3,
    )


def vllm_serve_arguments(values: dict[str, Any]) -> list[str]:
    """`vllm serve` flags for engine arguments: --name-with-dashes VALUE, booleans as bare flags."""
    arguments: list[str] = []
    for name, value in values.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            arguments.append(flag)
        elif value is not False and value is not None:
            arguments += [flag, str(value)]
    return arguments


@dataclass
class OpenAIServer:
    """`vllm serve` (vLLM's OpenAI API server) in a session of its own: the parts of ServerProcess the
    benchmark uses."""

    process: subprocess.Popen
    http_port: int
    log_path: Path
    transport: str = "openai"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def is_ready(self) -> bool:
        import requests

        try:
            return requests.get(f"{self.http_url}/v1/models", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def process_groups(self) -> dict[str, list[Any]]:
        """The API server (under "tritonserver", the frontend's column) and its engine process(es)."""
        import psutil

        try:
            frontend = psutil.Process(self.process.pid)
            children = frontend.children(recursive=True)
        except psutil.NoSuchProcess:
            return {"tritonserver": [], "stub": [], "engine": []}
        return {"tritonserver": [frontend], "stub": [], "engine": children}

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def start_vllm_serve(model: str, log_path: Path, timeout: float = 300.0) -> tuple[OpenAIServer, float]:
    """vLLM's OpenAI API server on a free port, serving `MODEL`; returns it and its seconds to ready."""
    values = peer_engine_values(model)
    (port,) = local_server.free_ports(1)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(values["model"])]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--disable-log-requests"]
    command += vllm_serve_arguments(values)
    env = dict(os.environ, VLLM_USE_V1="0", VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB)
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = OpenAIServer(process, port, log_path)
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}: see {log_path}")
        if server.is_ready():
            return server, time.monotonic() - started
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"vllm serve not ready within {timeout} s: see {log_path}")
