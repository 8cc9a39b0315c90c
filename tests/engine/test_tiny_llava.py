"""The tiny LLaVA demo model: a deterministic build that transformers reads whole.

Owns checking demo/tiny_llava.py's folder: the same bytes on every build, every weight loaded by
transformers 4.51's LlavaForConditionalGeneration, `<image>` expanded to the model's image tokens.
That vLLM answers as transformers does, with images, at 8 steps and 1, is in test_image_prompts.py.
Must not download anything.
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import tiny_llava

ONE_IMAGE = "user: <image>\nWhat is in the image?\nassistant:"


def _red() -> Image.Image:
    return Image.new("RGB", (64, 64), (255, 0, 0))


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
