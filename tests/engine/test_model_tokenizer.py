"""stub/model_tokenizer.py against vLLM 0.8.5's get_tokenizer: the multi-step stub's tokenizer, loaded
without vLLM or torch, encodes, decodes and counts token ids exactly as vLLM's engine's does, on
every demo model's tokenizer (byte-level BPE, SentencePiece, SmolLM2's, BERT's WordPiece)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.events import token_ids_of
from triton_vllm_multistep.stub.model_tokenizer import TokenizerSource, load_tokenizer

TEXTS = [
    "hello world",
    "  leading spaces and\ttabs\nnewlines",
    "Ünïcödé — 日本語のテキスト 🙂🚀",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>",
    "<s> </s> [CLS] [SEP] <unk>",
    "x" * 300,
]
# (model, tokenizer_mode): `slow` where the files have a slow tokenizer (the others ship tokenizer.json only).
TOKENIZERS = [
    ("tiny-llama-bpe", "auto"),
    ("tiny-llama-spm", "auto"),
    ("smollm2-135m-instruct", "auto"),
    ("all-minilm-l6-v2", "auto"),
    ("all-minilm-l6-v2", "slow"),
]


@pytest.mark.parametrize(("name", "mode"), TOKENIZERS)
def test_the_stubs_tokenizer_is_vllms(name: str, mode: str) -> None:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    folder = str(demo_models.build(name))  # set-up built them all
    ours = load_tokenizer(TokenizerSource(folder, mode))
    vllms = get_tokenizer(folder, tokenizer_mode=mode)
    assert type(ours).__name__ == type(vllms).__name__.removeprefix("Cached")
    for text in TEXTS:
        ids = vllms.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == vllms.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == vllms.decode(ids, skip_special_tokens=True), text
    assert token_ids_of(ours, 10**9) == token_ids_of(vllms, 10**9) == vllms.max_token_id + 1


def test_the_source_follows_vllms_engine_args_defaults() -> None:
    assert TokenizerSource.of_engine_args({"model": "/m"}) == TokenizerSource("/m", "auto", False, None)
    given = {"model": "/m", "tokenizer": "/t", "tokenizer_mode": "slow", "tokenizer_revision": "r"}
    assert TokenizerSource.of_engine_args(given) == TokenizerSource("/t", "slow", False, "r")
    assert not TokenizerSource("/t").needs_vllm
    for needs in (TokenizerSource("/t", "mistral"), TokenizerSource("/t", "custom"), TokenizerSource("/t.gguf")):
        assert needs.needs_vllm
    assert TokenizerSource("/t", trust_remote_code=True).needs_vllm  # its code may need torch


def test_loading_it_imports_neither_vllm_nor_torch_and_leaves_no_setting_behind() -> None:
    """What the stub of an engine process loads (~0.9 CPU-s, ~80-140 MB resident, against ~9.6 CPU-s and
    ~870 MB through vLLM's get_tokenizer): the variable that keeps torch out is gone once loaded, so the
    engine processes this stub starts later still see torch."""
    code = (
        "import json, os, sys\n"
        "from triton_vllm_multistep.stub.model_tokenizer import TokenizerSource, load_tokenizer\n"
        "tokenizer = load_tokenizer(TokenizerSource(sys.argv[1]))\n"
        "print(json.dumps({'ids': tokenizer.encode('hello world'), 'use_torch': os.environ.get('USE_TORCH'),\n"
        "  'loaded': sorted(n for n in ('vllm', 'torch') if n in sys.modules)}))\n"
    )
    folder = str(demo_models.build("smollm2-135m-instruct"))
    out = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["loaded"] == [] and seen["use_torch"] is None, seen
    assert seen["ids"] == load_tokenizer(TokenizerSource(folder), with_vllm=True).encode("hello world")
