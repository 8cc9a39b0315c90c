"""The multimodal demo model: a tiny random-weight LLaVA (CLIP vision tower, projector, Llama).

Owns building the `tiny-llava` folder deterministically (same seed, same bytes): the config,
seeded float32 weights named as transformers 4.51's LlavaForConditionalGeneration saves them
(which vLLM 0.8.5's llava loader also reads), and a LlavaProcessor whose tokenizer is
tiny-llama-bpe's plus an `<image>` token; must not download anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from triton_vllm_multistep.demo import tiny_llama
from triton_vllm_multistep.demo.cache import publish

if TYPE_CHECKING:
    import torch
    from transformers import LlavaConfig

NAME = "tiny-llava"
SEED = 4321
IMAGE_TOKEN = "<image>"
BASE_MODEL = "tiny-llama-bpe"  # whose tokenizer this model extends

IMAGE_SIZE = 64
PATCH_SIZE = 16
# "default" drops the CLS token: one image is (64 / 16)^2 = 16 tokens.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

VISION = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 64,
}
TEXT = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
# CLIP's normalisation constants (what openai/clip-vit-* ship).
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

# Message contents are plain strings: vLLM's chat path writes `<image>` into them itself.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' if loop.first else '' }}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _write_processor(base: Path, folder: Path) -> tuple[int, int]:
    """Tokenizer (the base one plus `<image>`), CLIP image processor and LlavaProcessor.

    Returns the vocabulary size and the id of `<image>`.
    """
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    # No token_type_ids: LlavaForConditionalGeneration.generate refuses inputs it does not use.
    tokenizer = AutoTokenizer.from_pretrained(base, model_input_names=["input_ids", "attention_mask"])
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        # The CLS token: without it transformers expands `<image>` to one token fewer than vLLM does.
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(folder)
    return len(tokenizer), tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def _config(vocab_size: int, image_token_index: int) -> LlavaConfig:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text_config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **TEXT,
    )
    text_config.architectures = ["LlamaForCausalLM"]  # vLLM builds the language model from this
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text_config,
        image_token_index=image_token_index,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=IMAGE_TOKENS,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def _initial_value(
    name: str, shape: tuple[int, ...], normal: Callable[[tuple[int, ...], float], torch.Tensor]
) -> torch.Tensor:
    """The value of parameter `name`: norms one, biases zero, the rest seeded normal (scaled by fan-in)."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and name.endswith(".weight"):  # LayerNorm / RMSNorm scales
        return torch.ones(shape)
    if name.endswith(("embed_tokens.weight", "position_embedding.weight", "class_embedding")):
        return normal(shape, 1.0)
    if name == "language_model.lm_head.weight":
        # A large output scale keeps greedy choices far from ties, so engines agree exactly.
        return normal(shape, 0.5)
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    std = fan_in**-0.5
    if name == "multi_modal_projector.linear_2.weight":
        # Image embeddings a few times larger than the text ones, so the image decides the answer.
        std *= 4.0
    return normal(shape, std)


def _write_model(folder: Path, vocab_size: int, image_token_index: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlavaForConditionalGeneration

    config = _config(vocab_size, image_token_index)
    config.save_pretrained(folder)
    # The parameter names and shapes, from transformers' own class (no memory, no random init).
    with torch.device("meta"):
        skeleton = LlavaForConditionalGeneration(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    generator = torch.Generator().manual_seed(SEED)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    tensors = {name: _initial_value(name, shapes[name], normal).contiguous() for name in sorted(shapes)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=1))


def build(root: Path, force: bool = False) -> Path:
    """Build `tiny-llava` under `root` unless present (its tokenizer's base model too); return its folder."""
    target = root / NAME
    if (target / "model.safetensors").exists() and not force:
        return target
    base = tiny_llama.build(BASE_MODEL, root)

    def write(staging: Path) -> None:
        vocab_size, image_token_index = _write_processor(base, staging)
        _write_model(staging, vocab_size, image_token_index)

    return publish(target, write)
