"""Multi-node tensor parallel through vLLM's Ray executor: what can be checked without GPUs or Ray.

Owns the model.json → EngineArgs path for `distributed_executor_backend: "ray"` and what a CPU
host does with it; a Ray cluster of GPU nodes cannot run here (docs/scaling-out.md).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest

from triton_vllm_multistep.engine.engine_args import engine_values, to_engine_args
from triton_vllm_multistep.engine.factory import EngineBuildError, cpu_multistep_config
from triton_vllm_multistep.settings import backend
from triton_vllm_multistep.settings.engine_json import engine_values as filled_engine_values

MULTI_NODE = {
    "model": "demo://tiny-llama-bpe",
    "max_model_len": 256,
    "num_scheduler_steps": 8,
    "distributed_executor_backend": "ray",
    "tensor_parallel_size": 16,  # e.g. two nodes of 8 GPUs
}


def _engine_args(engine_json: dict):
    stream_mode = backend.backend_settings({}, engine_json).stream_mode
    return to_engine_args(engine_values(filled_engine_values(engine_json, Path("."), stream_mode)))


def test_model_json_ray_executor_and_tensor_parallel_reach_engine_args(demo_model_paths: dict) -> None:
    args = _engine_args(MULTI_NODE)
    assert args.distributed_executor_backend == "ray"
    assert args.tensor_parallel_size == 16 and args.pipeline_parallel_size == 1
    assert args.num_scheduler_steps == 8


def test_cpu_host_refuses_tensor_parallel_with_the_reason(demo_model_paths: dict) -> None:
    with pytest.raises(EngineBuildError, match="tensor_parallel_size and pipeline_parallel_size must be 1"):
        cpu_multistep_config(_engine_args(MULTI_NODE), stream_mode="step")


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray installed: vLLM's CPU platform uses mp")
def test_cpu_host_without_ray_refuses_the_ray_executor(demo_model_paths: dict) -> None:
    """vLLM 0.8.5 checks Ray is importable when the config asks for it (Ray is an optional extra here)."""
    single = _engine_args(MULTI_NODE | {"tensor_parallel_size": 1, "dtype": "float32"})
    with pytest.raises(ValueError, match="install Ray"):
        cpu_multistep_config(single, stream_mode="step")
