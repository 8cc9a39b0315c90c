"""Image prompts through the engine loop with the CPU multi-step runner: exact, and failing alone.

Real vLLM 0.8.5 engines (the CPU multi-step runner at 8 steps, vLLM's own at 1) on the tiny LLaVA
demo model, driven by EngineLoop (images processed on its image prompt thread, engine/multimodal.py):
requests with one or two images, greedy and seeded, a constrained one, and text-only requests in one
batch get the same tokens at 8 steps as at 1 and as alone, greedy ones the tokens of transformers'
LLaVA; the prompt is counted with its image tokens; a prompt the model's processor cannot take fails
alone; an abort while the prompt is processed drops it. M-RoPE models are refused with multi-step on
CPU and (vLLM's CUDA platform simulated) on GPU.
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from simulated_cuda import simulated_cuda
from transformers import AutoTokenizer
from vllm import EngineArgs

from triton_vllm_multistep.checks import image_prompts as multimodal
from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import tiny_llava
from triton_vllm_multistep.engine.events import EngineRequest
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine, cpu_multistep_config
from triton_vllm_multistep.engine.gpu_multistep import WindowClosingEngine
from triton_vllm_multistep.engine.loop import EngineLoop

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build(tiny_llava.NAME)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def _params(seed: int | None = None, **extra: Any) -> dict[str, Any]:
    """Sampling fields as the stub sends them (EngineRequest.sampling)."""
    return {
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0 if seed is None else 1.0,
        **({} if seed is None else {"seed": seed}),
        "ignore_eos": True,
        "output_kind": "DELTA",
        **extra,
    }


def _request(
    request_id: str, prompt: list[int], params: dict[str, Any], images: Sequence[Image.Image] = ()
) -> EngineRequest:
    """An EngineRequest with the images as the stub sends them: their files."""
    return EngineRequest(request_id, tuple(prompt), params, images=tuple(multimodal.image_file(i) for i in images))


def _requests(tokenizer: Any) -> dict[str, tuple[list[int], list[Image.Image], dict[str, Any]]]:
    one = tokenizer.encode(multimodal.IMAGE_PROMPT)
    two = tokenizer.encode(multimodal.TWO_IMAGE_PROMPT)
    red, noise = multimodal.solid_image(), multimodal.noise_image()
    return {
        "red": (one, [red], _params()),
        "noise": (one, [noise], _params()),
        "red-again": (one, [red], _params()),
        "two": (two, [red, noise], _params()),
        "two-swapped": (two, [noise, red], _params()),
        "noise-seeded": (one, [noise], _params(seed=3)),
        "red-choice": (one, [red], _params(guided_decoding={"choice": ["red", "noise", "blue"]})),
        "text": (tokenizer.encode(multimodal.TEXT_PROMPT), [], _params()),
    }


def _serve(model_dir: Path, steps: int, requests: dict[str, tuple[list[int], list[Image.Image], dict[str, Any]]]):
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        num_scheduler_steps=steps,
        seed=0,
        limit_mm_per_prompt={"image": 2},
    )
    loop = EngineLoop(lambda: build_engine(args, stream_mode="step"))
    loop.start_engine()
    collector = EventCollector(expected=len(requests))
    try:
        assert loop.facts.images_per_prompt == 2 and loop.facts.multimodal
        loop.serve(collector.sink)
        for request_id, (prompt, images, params) in requests.items():
            loop.submit(_request(request_id, prompt, params, images))
        assert collector.done.wait(600), "not every request ended"
    finally:
        loop.shutdown()
    return collector


@pytest.fixture(scope="module")
def served(model_dir: Path, tokenizer: Any) -> dict[str, EventCollector]:
    requests = _requests(tokenizer)
    batch = {steps: _serve(model_dir, steps, requests) for steps in (8, 1)}
    alone = _serve(model_dir, 8, {"red": requests["red"]})
    return {"steps8": batch[8], "steps1": batch[1], "alone": alone}


def test_image_prompts_at_8_steps_equal_1_step_beside_each_other_and_text(
    served: dict[str, EventCollector], tokenizer: Any
) -> None:
    multi, single = served["steps8"], served["steps1"]
    assert multi.failed == {} and single.failed == {}
    assert set(multi.tokens) == set(_requests(tokenizer))
    for request_id, tokens in multi.tokens.items():
        assert tokens == single.tokens[request_id], request_id
    assert multi.steps_per_output == {1}  # one output per decoded step
    assert served["alone"].tokens["red"] == multi.tokens["red"]


def test_the_image_decides_the_answer_and_the_same_image_gives_the_same(
    served: dict[str, EventCollector], tokenizer: Any
) -> None:
    tokens = served["steps8"].tokens
    assert tokens["red"] == tokens["red-again"]
    assert len({tuple(tokens[name]) for name in ("red", "noise", "two", "two-swapped", "text")}) == 5
    assert tokenizer.decode(tokens["red-choice"], skip_special_tokens=True) in ("red", "noise", "blue")


def test_greedy_image_answers_equal_transformers_llava(
    served: dict[str, EventCollector], model_dir: Path, tokenizer: Any
) -> None:
    red, noise = multimodal.solid_image(), multimodal.noise_image()
    cases = {
        "red": (multimodal.IMAGE_PROMPT, [red]),
        "noise": (multimodal.IMAGE_PROMPT, [noise]),
        "two": (multimodal.TWO_IMAGE_PROMPT, [red, noise]),
    }
    for request_id, (prompt, images) in cases.items():
        prompt_ids, reference = multimodal.transformers_greedy(model_dir, prompt, images, MAX_TOKENS)
        assert served["steps8"].tokens[request_id] == reference, request_id
        # The prompt as vLLM counts it: every `<image>` expanded to the image's tokens.
        assert served["steps8"].prompt_tokens[request_id] == len(prompt_ids)
        assert len(prompt_ids) == len(tokenizer.encode(prompt)) + len(images) * (tiny_llava.IMAGE_TOKENS - 1)


def test_a_prompt_the_processor_cannot_take_fails_alone_and_an_abort_while_processing_drops_it(
    model_dir: Path, tokenizer: Any
) -> None:
    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=512, num_scheduler_steps=8, seed=0)
    loop = EngineLoop(lambda: build_engine(args, stream_mode="step"))
    loop.start_engine()
    collector = EventCollector(expected=4)
    red = multimodal.solid_image()
    try:
        # Aborted before the engine thread serves: whether its prompt is still being processed or
        # already queued for admission when the abort is handled, it never reaches the engine.
        loop.submit(_request("aborted", tokenizer.encode(multimodal.IMAGE_PROMPT), _params(), [red]))
        loop.abort("aborted")
        loop.serve(collector.sink)
        loop.submit(_request("no-placeholder", tokenizer.encode(multimodal.TEXT_PROMPT), _params(), [red]))
        loop.submit(_request("good", tokenizer.encode(multimodal.IMAGE_PROMPT), _params(), [red]))
        loop.submit(_request("text", tokenizer.encode(multimodal.TEXT_PROMPT), _params()))
        # Two placeholders for one image, beyond this engine's limit of one image per prompt.
        loop.submit(_request("too-many", tokenizer.encode(multimodal.TWO_IMAGE_PROMPT), _params(), [red, red]))
        assert collector.done.wait(300), collector.failed
    finally:
        loop.shutdown()
    assert set(collector.failed) == {"no-placeholder", "too-many"}, collector.failed
    assert collector.failed["no-placeholder"].startswith("the image prompt cannot be processed: ")
    assert "image" in collector.failed["too-many"]
    assert len(collector.tokens["good"]) == len(collector.tokens["text"]) == MAX_TOKENS
    assert "aborted" not in collector.tokens


def test_m_rope_models_are_refused_with_multi_step_on_cpu_and_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = multimodal.write_mrope_model(tmp_path / "qwen2-vl")
    args = EngineArgs(model=str(folder), num_scheduler_steps=8, max_model_len=256, skip_tokenizer_init=True)
    with pytest.raises(EngineBuildError) as on_cpu:
        cpu_multistep_config(args, "step")
    for message in (str(on_cpu.value),):
        assert message.startswith("num_scheduler_steps=8 cannot serve this model")
        assert "uses M-RoPE" in message and "set num_scheduler_steps to 1 for this model" in message

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("no engine may be built for a refused model")

    monkeypatch.setattr(WindowClosingEngine, "from_vllm_config", classmethod(never))
    with simulated_cuda():
        gpu_args = EngineArgs(
            model=str(folder), num_scheduler_steps=8, max_model_len=256, skip_tokenizer_init=True, dtype="bfloat16"
        )
        with pytest.raises(EngineBuildError) as on_gpu:
            build_engine(gpu_args, stream_mode="step")
    assert str(on_gpu.value) == str(on_cpu.value)


def test_prefix_caching_with_a_multimodal_model_is_a_load_error_not_silently_dropped(model_dir: Path) -> None:
    """vLLM 0.8.5 (V0) turns prefix caching off for multimodal models with a warning; here it is refused."""
    for steps in (8, 1):
        args = EngineArgs(model=str(model_dir), num_scheduler_steps=steps, enable_prefix_caching=True)
        with pytest.raises(EngineBuildError, match="enable_prefix_caching cannot serve .*a multimodal model"):
            build_engine(args, stream_mode="step")
