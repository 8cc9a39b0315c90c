"""Start-up warm-up on the tiny demo model: it runs through the real engine and turns a failing
first request into a load error.

Owns the warm-up's checks; must not mock vLLM (a forward hook raising stands for a broken kernel).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from vllm import EngineArgs, SamplingParams

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.cpu_attention import ipex_available
from triton_vllm_multistep.engine.factory import build_engine
from triton_vllm_multistep.engine.loop import driver_model
from triton_vllm_multistep.engine.prefix_cache import prefix_cache_hit_rate
from triton_vllm_multistep.engine.warmup import EngineWarmupError, warm_up

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def demo_path() -> str:
    return str(demo_models.build("tiny-llama-bpe"))


def _engine_args(path: str, steps: int, caching: bool) -> EngineArgs:
    return EngineArgs(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_scheduler_steps=steps,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_prefix_caching=caching,
        seed=0,
        disable_log_stats=True,
    )


@pytest.fixture(scope="module")
def cached_engine(demo_path: str) -> Iterator[object]:
    if not ipex_available():
        pytest.skip("prefix caching on CPU needs IPEX (scripts/setup.sh)")
    engine = build_engine(_engine_args(demo_path, 8, True))
    yield engine
    del engine
    gc.collect()


def test_warm_up_hits_the_prefix_cache_inside_a_window_and_leaves_the_engine_clean(cached_engine) -> None:
    engine = cached_engine
    hit_rates: list[float] = []
    windows: list[int] = []
    runner = engine.driver_worker().model_runner

    def observe(*_: object) -> None:
        hit_rates.append(prefix_cache_hit_rate(engine.scheduler))
        window = runner.windows.get(0)
        windows.append(window.num_steps if window is not None else 0)

    handle = driver_model(engine).register_forward_pre_hook(observe)
    try:
        report = warm_up(engine)
    finally:
        handle.remove()
    # Three requests of 8 + 4 + 1 = 13 tokens each; prefix blocks were found in the cache.
    assert report.generated_tokens == 3 * 13
    assert max(hit_rates) > 0
    assert 8 in windows  # a multi-step window ran
    # Idle, every block free, and the gauge forgets the warm-up's hits.
    assert not engine.has_unfinished_requests()
    assert engine.scheduler[0].block_manager.get_num_free_gpu_blocks() == NUM_BLOCKS
    assert prefix_cache_hit_rate(engine.scheduler) == 0.0


def test_warm_up_leaves_generation_unchanged(demo_path: str, cached_engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    cold = build_engine(_engine_args(demo_path, 8, True))
    try:
        cold.add_request("cold", "hello world", params)
        while cold.has_unfinished_requests():
            outputs = cold.step()
        cold_tokens = list(outputs[0].outputs[0].token_ids)
    finally:
        del cold
        gc.collect()
    warm_up(cached_engine)
    cached_engine.add_request("warm", "hello world", params)
    while cached_engine.has_unfinished_requests():
        outputs = cached_engine.step()
    assert list(outputs[0].outputs[0].token_ids) == cold_tokens


def test_a_failing_first_request_fails_the_warm_up_naming_the_settings(demo_path: str) -> None:
    engine = build_engine(_engine_args(demo_path, 8, False))
    try:

        def broken_kernel(*_: object) -> None:
            raise ModuleNotFoundError("No module named 'intel_extension_for_pytorch'")

        driver_model(engine).register_forward_pre_hook(broken_kernel)
        with pytest.raises(EngineWarmupError) as raised:
            warm_up(engine, _engine_args(demo_path, 8, False))
        message = str(raised.value)
        assert "first request would fail" in message
        assert "intel-extension-for-pytorch==2.6.0" in message
        assert "num_scheduler_steps=8" in message
        assert not engine.has_unfinished_requests()
    finally:
        del engine
        gc.collect()
