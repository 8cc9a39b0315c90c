"""Image prompts for the GPU smoke check and the tests: deterministic images, their base64 and file
forms, transformers' greedy answer for the tiny LLaVA demo model, and a config-only M-RoPE model
(Qwen2-VL) for the load refusal.

Owns what the engine, served and GPU-smoke tests of image input share; imports torch and
transformers lazily (only the reference needs them) and is never imported by serving code.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# The tests' encoders are the product's: the `image` input's base64, and the file an EngineRequest carries.
from triton_vllm_multistep.interface import encode_image, image_file  # noqa: F401

IMAGE_PROMPT = "user: <image>\nWhat is in the image?\nassistant:"
TWO_IMAGE_PROMPT = "user: <image> and <image>\nCompare them.\nassistant:"
TEXT_PROMPT = "user: What is in the image?\nassistant:"


def solid_image(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (64, 64)) -> Image.Image:
    return Image.new("RGB", size, color)


def noise_image(seed: int = 7, size: tuple[int, int] = (64, 64)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def transformers_greedy(
    model_dir: Path, prompt: str, images: Sequence[Image.Image], max_tokens: int
) -> tuple[list[int], list[int]]:
    """(prompt ids with each `<image>` expanded, greedy new tokens) from transformers' LLaVA, float32."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    inputs = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    generation = copy.deepcopy(model.generation_config)
    generation.eos_token_id = None  # as vLLM's ignore_eos: an EOS is a token like any other
    generation.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=generation, max_new_tokens=max_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


def write_mrope_model(folder: Path, tokenizer_from: Path | None = None) -> Path:
    """A Qwen2-VL config (M-RoPE) without weights: enough for vLLM to build its engine config, which is
    where multi-step refuses it; `tokenizer_from` copies a tokenizer beside it for the stub."""
    import shutil

    from transformers import Qwen2VLConfig

    config: Any = Qwen2VLConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "spatial_merge_size": 2},
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    assert json.loads((folder / "config.json").read_text())["rope_scaling"]["mrope_section"] == [2, 3, 3]
    return folder
