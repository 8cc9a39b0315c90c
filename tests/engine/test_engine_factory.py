"""engine/factory.py: which engine and config each platform gets, and what multi-step refuses.

Owns the factory's contract checks; mocks only the CUDA platform branch, which cannot run here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch
from vllm import EngineArgs
from vllm.engine.llm_engine import LLMEngine

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.engine import factory as engine_factory
from triton_vllm_multistep.engine.cpu_multistep import WORKER_QUALNAME, CPUMultiStepEngine
from triton_vllm_multistep.engine.factory import (
    EngineBuildError,
    build_engine,
    cpu_multistep_config,
)


@pytest.fixture(scope="module")
def demo_path() -> str:
    return str(demo_models.build("tiny-llama-bpe"))


def _args(path: str, steps: int = 8, **kwargs: Any) -> EngineArgs:
    return EngineArgs(model=path, dtype="float32", max_model_len=256, num_scheduler_steps=steps, **kwargs)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"enable_chunked_prefill": True}, "chunked prefill"),
        ({"speculative_config": {"model": "[ngram]", "num_speculative_tokens": 2}}, "speculative"),
        ({"logits_processor_pattern": ".*"}, "logits processors"),
    ],
)
def test_multi_step_refuses_what_it_cannot_run(demo_path: str, setting: dict[str, Any], named: str) -> None:
    with pytest.raises(EngineBuildError, match=named):
        build_engine(_args(demo_path, **setting))


def test_cpu_refuses_tensor_parallel_with_multi_step(demo_path: str) -> None:
    with pytest.raises(EngineBuildError, match="init_shm_manager"):
        build_engine(_args(demo_path, tensor_parallel_size=2))


def test_tensor_parallel_refusal_reason_still_holds() -> None:
    """vLLM's CPU communicator needs shared-memory all-reduce ops this wheel lacks; if a future
    build ships them, revisit the TP refusal (the multi-step worker would need a TP path)."""
    import vllm._C  # noqa: F401  registers the custom ops

    assert hasattr(torch.ops._C, "rms_norm")
    assert not hasattr(torch.ops._C, "init_shm_manager")


def test_cpu_config_carries_the_multi_step_settings(demo_path: str) -> None:
    args = _args(demo_path, steps=8)
    before = dataclasses.asdict(args)
    config = cpu_multistep_config(args, stream_mode="window")
    assert dataclasses.asdict(args) == before  # the caller's arguments are left alone
    scheduler = config.scheduler_config
    assert scheduler.num_scheduler_steps == 8
    assert scheduler.is_multi_step
    assert scheduler.num_lookahead_slots == 7
    assert scheduler.multi_step_stream_outputs is False
    assert config.parallel_config.worker_cls == WORKER_QUALNAME
    assert not config.model_config.use_async_output_proc


def test_cpu_refuses_a_foreign_worker(demo_path: str) -> None:
    with pytest.raises(EngineBuildError, match="worker_cls"):
        cpu_multistep_config(_args(demo_path, worker_cls="vllm.worker.cpu_worker.CPUWorker"), stream_mode="step")


def test_single_step_on_cpu_is_vllms_engine(demo_path: str) -> None:
    engine = build_engine(_args(demo_path, steps=1))
    assert type(engine) is LLMEngine
    assert type(engine.model_executor.driver_worker.worker).__name__ == "CPUWorker"


def test_multi_step_on_cpu_is_ours(demo_path: str) -> None:
    engine = build_engine(_args(demo_path, steps=4), stream_mode="step")
    assert isinstance(engine, CPUMultiStepEngine)
    assert engine.scheduler_config.num_scheduler_steps == 4
    assert engine.driver_worker().model_runner.step_output_callback is not None


# The GPU branch of build_engine (vLLM's MultiStepWorker, checked at load) is tested with vLLM's
# CUDA platform simulated in test_gpu_config_simulated.py.


def test_model_class_is_inspected_in_process_not_in_a_subprocess(demo_path: str, monkeypatch) -> None:
    """Cold start: vLLM's architecture inspection must not spawn its ~8 s Python subprocess."""
    from vllm.model_executor.models import registry

    engine_factory.preload_model_classes(_args(demo_path))  # [] when an earlier test preloaded it
    assert isinstance(registry.ModelRegistry.models["LlamaForCausalLM"], registry._RegisteredModel)

    def no_subprocess(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("vLLM inspected the model class in a subprocess")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    registry._try_inspect_model_cls.cache_clear()
    config = cpu_multistep_config(_args(demo_path), stream_mode="step")
    assert config.model_config.architectures == ["LlamaForCausalLM"]
    assert config.model_config.runner_type == "generate"


def test_a_served_engine_leaves_a_core_unless_the_user_chose_threads(monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert engine_factory.serving_torch_threads() == (cores - 1 if cores > 1 else None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert engine_factory.serving_torch_threads() == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert engine_factory.serving_torch_threads() is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_factory.serving_torch_threads() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert engine_factory.serving_torch_threads() is None


def test_a_compute_bound_model_gets_every_core(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    small, large = 5_000_000, engine_factory.FORWARD_BOUND_PARAMETERS
    assert engine_factory.serving_torch_threads(small) == 7
    assert engine_factory.serving_torch_threads(large) == 8
    assert engine_factory.serving_torch_threads(None) == 7  # size unknown: the response path keeps its core
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert engine_factory.serving_torch_threads(large) is None  # the user's choice wins


def test_the_loop_applies_a_thread_policy_chosen_from_the_built_engine(demo_path: str) -> None:
    """The demo model (~5M parameters) leaves a core; the count is what the engine thread runs with."""
    import torch

    from triton_vllm_multistep.engine.loop import EngineLoop, model_parameters

    chosen: list[int | None] = []

    def policy(engine) -> int | None:
        parameters = model_parameters(engine)
        assert parameters is not None and 1_000_000 < parameters < engine_factory.FORWARD_BOUND_PARAMETERS
        chosen.append(1)
        return 1

    before = torch.get_num_threads()
    loop = EngineLoop(lambda: build_engine(_args(demo_path, steps=4), stream_mode="step"), policy)
    try:
        loop.start_engine()
        assert chosen == [1] and loop.torch_threads == 1
    finally:
        loop.stop()
        loop.engine.model_executor.shutdown()
        torch.set_num_threads(before)


def test_the_users_choice_is_read_before_the_build_sets_omp_num_threads(demo_path: str, monkeypatch) -> None:
    """vLLM's CPU platform sets OMP_NUM_THREADS while building: read after the build, it would look
    like the user's choice and the policy would never apply."""
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # recorded, so what vLLM sets below is undone after the test
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(4)))
    before_build = cpu_placement.thread_choice_of_user()
    cpu_multistep_config(_args(demo_path), stream_mode="step")
    assert os.environ.get("OMP_NUM_THREADS")  # what vLLM did
    assert engine_factory.serving_torch_threads(5_000_000) is None  # the environment alone misleads
    assert engine_factory.serving_torch_threads(5_000_000, before_build) == 3
    assert engine_factory.serving_torch_threads(engine_factory.FORWARD_BOUND_PARAMETERS, before_build) == 4
