"""The real demo model's converted folder behaves as upstream SmolLM2-135M-Instruct, and the cache is checked.

Uses the machine's cached conversion (built once by scripts/setup.sh or the first server start);
the build itself compares every output file with known SHA-256s, so a passing build is also the
determinism check (two conversions gave those same bytes when they were recorded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2

CHAT_PREFIX = [1, 9690, 198]  # <|im_start|>system\n
GENERATION_PROMPT = [1, 520, 9531, 198]  # <|im_start|>assistant\n


@pytest.fixture(scope="module")
def real_model_path() -> Path:
    return demo_models.build(smollm2.NAME)


def test_folder_holds_exactly_the_checked_files(real_model_path: Path) -> None:
    assert sorted(p.name for p in real_model_path.iterdir()) == sorted(smollm2.EXPECTED_SHA256)
    assert smollm2.cache_problem(real_model_path) is None


def test_tokenizer_is_upstreams_chatml_with_eos_im_end_and_no_bos(real_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.encode("Hello world") == [19556, 905]  # no BOS added
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("in 2025")) == ["in", "Ġ", "2", "0", "2", "5"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:3] == CHAT_PREFIX and ids[-4:] == GENERATION_PROMPT
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([2], skip_special_tokens=True) == ""


def test_model_config_ties_embeddings_and_stops_at_im_end(real_model_path: Path) -> None:
    config = AutoConfig.from_pretrained(real_model_path)
    assert config.tie_word_embeddings and config.eos_token_id == 2 and config.vocab_size == 49152
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (576, 30, 3)
    assert GenerationConfig.from_pretrained(real_model_path).eos_token_id == 2


def test_a_changed_file_in_the_cache_is_found(real_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / smollm2.NAME
    copy.mkdir()
    for path in real_model_path.iterdir():
        if path.name == "model.safetensors":
            os.link(path, copy / path.name)  # same bytes, no 0.5 GB copy (never written to)
        else:
            (copy / path.name).write_bytes(path.read_bytes())
    assert smollm2.cache_problem(copy) is None  # verified by hashing, then trusted by its stamp
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": 1}))
    assert "differs from the expected conversion in: generation_config.json" in (smollm2.cache_problem(copy) or "")
