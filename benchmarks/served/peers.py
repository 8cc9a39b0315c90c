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

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.served.settings import KV_CACHE_GIB, MODEL, engine_json
from triton_vllm_multistep.testing import local_server, vllm_serve
from triton_vllm_multistep.testing.local_server import ServerProcess
from triton_vllm_multistep.testing.vllm_serve import VllmServe

TRITON_VLLM_BACKEND = "triton_vllm_backend"
VLLM_SERVE = "vllm_serve"
VLLM_SERVE_V1 = "vllm_serve_v1"  # vLLM's current engine (the V1 environment's vLLM), beside our V1 models
PEER_KINDS = (TRITON_VLLM_BACKEND, VLLM_SERVE, VLLM_SERVE_V1)

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


def start_vllm_serve(model: str, log_path: Path) -> tuple[VllmServe, float]:
    """vLLM's OpenAI API server (this environment's vLLM) on a free port, serving `MODEL`; returns it
    and its seconds to ready."""
    values = {**peer_engine_values(model), "disable_log_requests": True}
    environment = {"VLLM_USE_V1": "0", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    return vllm_serve.start_vllm_serve(sys.executable, values, MODEL, log_path, environment)


def start_vllm_serve_v1(
    model: str, log_path: Path, engine_fields: dict[str, Any], environment: dict[str, str] | None = None
) -> tuple[VllmServe, float]:
    """vLLM's OpenAI API server of the V1 environment (vLLM 0.32) on a free port, serving `MODEL` with
    the engine arguments our V1 model runs (no num_scheduler_steps; `engine_fields` on top), with
    `environment` over the KV cache setting."""
    from triton_vllm_multistep.settings.v1_environment import v1_environment_python

    python = v1_environment_python()
    if python is None:
        raise SystemExit("vllm_serve_v1 needs the V1 environment (.venv-v1): run scripts/setup.sh")
    values = {**peer_engine_values(model), **engine_fields}
    return vllm_serve.start_vllm_serve(
        python, values, MODEL, log_path, {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **(environment or {})}
    )
