"""The tiny LLaVA demo model: deterministic build, and vLLM 0.8.5 (CPU) answers as transformers does.

Owns checking demo/tiny_llava.py's folder against both consumers: transformers 4.51 loads every
weight and expands `<image>` as vLLM does; vLLM's greedy tokens for a prompt with images equal
transformers' LlavaForConditionalGeneration.generate (float32, eager attention); the image decides
the answer. Must not download anything.
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import base64
import gc
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration
from vllm import LLM, SamplingParams

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import tiny_llava

MAX_TOKENS = 16
ONE_IMAGE = "user: <image>\nWhat is in the image?\nassistant:"
TWO_IMAGES = "user: <image> and <image>\nCompare them.\nassistant:"


def _red() -> Image.Image:
    return Image.new("RGB", (64, 64), (255, 0, 0))


def _noise() -> Image.Image:
    pixels = np.random.default_rng(7).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build(tiny_llava.NAME)


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> object:
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> LlavaForConditionalGeneration:
    model, info = LlavaForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model.eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    engine = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        num_scheduler_steps=1,
        limit_mm_per_prompt={"image": 2},
        seed=0,
    )
    yield engine
    del engine
    gc.collect()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_greedy(
    hf_model: LlavaForConditionalGeneration, processor: object, prompt: str, images: list[Image.Image]
) -> tuple[list[int], list[int]]:
    """(prompt token ids after `<image>` expansion, greedy new tokens) from transformers."""
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


def _vllm_greedy(llm: LLM, prompts: list[tuple[str, list[Image.Image]]]) -> list[tuple[list[int], list[int]]]:
    requests = [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in prompts]
    outputs = llm.generate(requests, _greedy(), use_tqdm=False)
    return [(list(out.prompt_token_ids), list(out.outputs[0].token_ids)) for out in outputs]


def test_build_is_deterministic_and_registered(tmp_path: Path) -> None:
    first = demo_models.build(tiny_llava.NAME, tmp_path / "a")
    second = demo_models.build(tiny_llava.NAME, tmp_path / "b")
    assert demo_models.build(tiny_llava.NAME, tmp_path / "a") == first  # a cached build is reused
    assert tiny_llava.NAME in demo_models.all_names()
    assert Path(demo_models.resolve(f"demo://{tiny_llava.NAME}")).joinpath("model.safetensors").exists()
    assert demo_models.folder_digest(first) == demo_models.folder_digest(second)


def test_processor_expands_image_token_as_config_says(
    model_dir: Path, processor: object, hf_model: LlavaForConditionalGeneration
) -> None:
    config = hf_model.config
    assert config.architectures == ["LlavaForConditionalGeneration"]
    assert config.text_config.architectures == ["LlamaForCausalLM"]
    image_token = processor.tokenizer.convert_tokens_to_ids(tiny_llava.IMAGE_TOKEN)
    assert image_token == config.image_token_index == processor.image_token_id
    ids = processor(text=ONE_IMAGE, images=[_red()])["input_ids"][0]
    # "default" drops CLS: (image_size / patch_size)^2 tokens per image.
    assert ids.count(image_token) == tiny_llava.IMAGE_TOKENS == 16


def test_vllm_greedy_equals_transformers(llm: LLM, hf_model: LlavaForConditionalGeneration, processor: object) -> None:
    cases = [(ONE_IMAGE, [_red()]), (ONE_IMAGE, [_noise()]), (TWO_IMAGES, [_red(), _noise()])]
    for (prompt, images), (vllm_prompt, vllm_tokens) in zip(cases, _vllm_greedy(llm, cases), strict=True):
        hf_prompt, hf_tokens = _hf_greedy(hf_model, processor, prompt, images)
        assert vllm_prompt == hf_prompt  # vLLM expands `<image>` itself, to the same ids
        assert vllm_prompt.count(hf_model.config.image_token_index) == len(images) * tiny_llava.IMAGE_TOKENS
        assert vllm_tokens == hf_tokens, prompt


def test_the_image_decides_the_answer(llm: LLM) -> None:
    red, noise, red_again, two, swapped = _vllm_greedy(
        llm,
        [
            (ONE_IMAGE, [_red()]),
            (ONE_IMAGE, [_noise()]),
            (ONE_IMAGE, [_red()]),
            (TWO_IMAGES, [_red(), _noise()]),
            (TWO_IMAGES, [_noise(), _red()]),
        ],
    )
    assert red[1] != noise[1]
    assert red[1] == red_again[1]
    assert two[1] != swapped[1]  # image order matters too
    (text_only,) = llm.generate(["user: What is in the image?\nassistant:"], _greedy(), use_tqdm=False)
    assert list(text_only.outputs[0].token_ids) not in (red[1], noise[1])


def test_vllm_chat_with_an_image(llm: LLM) -> None:
    png = io.BytesIO()
    _red().save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
        }
    ]
    (out,) = llm.chat(messages, _greedy(), use_tqdm=False)
    image_token = llm.llm_engine.model_config.hf_config.image_token_index
    assert out.prompt_token_ids.count(image_token) == tiny_llava.IMAGE_TOKENS
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
