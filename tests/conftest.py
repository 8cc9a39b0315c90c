"""Fixtures for every test tier: the environment vLLM runs in and the demo models.

Tiers: unit/ (no vLLM engine, no server), engine/ (real vLLM, no server), e2e/ (real tritonserver).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The user's thread settings as the session started. vLLM's CPU platform writes OMP_NUM_THREADS
# into os.environ whenever a test builds an engine config in this process; servers started later
# would inherit it as if the user had chosen it (and skip the thread policy).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
_USER_THREADS = {name: os.environ.get(name) for name in _THREAD_VARIABLES}


def _restore_user_threads() -> None:
    for name, value in _USER_THREADS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module", autouse=True)
def user_thread_settings_per_module() -> None:
    """Before a module's own fixtures (its servers) start: autouse fixtures of a scope run first."""
    _restore_user_threads()


@pytest.fixture(autouse=True)
def user_thread_settings_per_test() -> None:
    _restore_user_threads()


@pytest.fixture(scope="session")
def demo_model_paths() -> dict[str, Path]:
    from triton_vllm_multistep.demo import models as demo_models

    return {name: demo_models.build(name) for name in demo_models.DEMO_MODELS}
