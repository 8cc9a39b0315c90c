"""Fixtures for every test tier: the environment vLLM runs in and the demo models.

Tiers: unit/ (no vLLM engine, no server), engine/ (real vLLM, no server), e2e/ (real tritonserver).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def demo_model_paths() -> dict[str, Path]:
    from triton_vllm_multistep.demo import models as demo_models

    return {name: demo_models.build(name) for name in demo_models.DEMO_MODELS}
