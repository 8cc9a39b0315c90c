"""The local demo models: deterministic builds, both tokenizer styles round-trip text, HF loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from triton_vllm_multistep.demo import models as demo_models

TEXTS = [
    "Hello world, the model streams every token.",
    "  leading and  double spaces\tand a tab",
    "你好 世界 模型推理 東京 こんにちは",
    "emoji 😀🚀 and accents café naïve — €42",
    "unseen words: xylophone quokka zephyr",
]


@pytest.mark.parametrize("name", sorted(demo_models.DEMO_MODELS))
def test_build_is_deterministic(tmp_path: Path, name: str) -> None:
    first = demo_models.build(name, tmp_path / "a")
    second = demo_models.build(name, tmp_path / "b")
    assert demo_models.folder_digest(first) == demo_models.folder_digest(second)
    # A cached build is reused as is.
    assert demo_models.build(name, tmp_path / "a") == first


@pytest.mark.parametrize("name", sorted(demo_models.DEMO_MODELS))
def test_tokenizer_round_trips_text(demo_model_paths: dict, name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_paths[name])
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_styles_differ_as_intended(demo_model_paths: dict) -> None:
    bpe = AutoTokenizer.from_pretrained(demo_model_paths["tiny-llama-bpe"])
    spm = AutoTokenizer.from_pretrained(demo_model_paths["tiny-llama-spm"])
    assert any(token.startswith("Ġ") for token in bpe.convert_ids_to_tokens(bpe.encode("the model streams")))
    spm_tokens = spm.convert_ids_to_tokens(spm.encode("the model streams 🎉"))
    assert any(token.startswith("▁") for token in spm_tokens)
    assert any(token.startswith("<0x") for token in spm_tokens)  # byte fallback for an emoji it never saw
    assert type(spm).__name__ == "LlamaTokenizerFast"


@pytest.mark.parametrize("name", sorted(demo_models.DEMO_MODELS))
def test_model_loads_in_transformers_and_generates(demo_model_paths: dict, name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_model_paths[name], torch_dtype=torch.float32)
    ids = torch.tensor([[1, 5, 6, 7]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert out.shape == (1, 8)
    assert model.config.architectures == ["LlamaForCausalLM"]


def test_resolve_demo_reference_and_unknown_name() -> None:
    assert demo_models.resolve("/some/folder") == "/some/folder"
    assert Path(demo_models.resolve("demo://tiny-llama-bpe")).joinpath("config.json").exists()
    with pytest.raises(ValueError, match="unknown demo model"):
        demo_models.build("no-such-model")
