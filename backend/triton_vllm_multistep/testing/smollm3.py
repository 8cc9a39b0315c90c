"""A tiny random SmolLM3 (the architecture of April 2025's SmolLM3), built in the V1 environment: a
model this environment's transformers (4.51) cannot load, served on `vllm_engine: v1` to show that
nothing in `.venv` loads a V1 model's config or tokenizer.

Owns building it (transformers 5 under the V1 environment's Python, a subprocess; the tokenizer is
the tiny demo model's, its vocabulary the model's) into the demo models' cache, once; knows nothing
of servers or of what is asserted.
"""

from __future__ import annotations

from pathlib import Path

from triton_vllm_multistep.checks.v1_reference import run_v1_script
from triton_vllm_multistep.demo import cache
from triton_vllm_multistep.demo import models as demo_models

NAME = "tiny-smollm3-random"

_SCRIPT = """
import sys, torch
from transformers import AutoTokenizer, SmolLM3Config, SmolLM3ForCausalLM
source, target = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(source)
torch.manual_seed(0)
config = SmolLM3Config(
    vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, torch_dtype="float32",
)
model = SmolLM3ForCausalLM(config)
model.save_pretrained(target)
tokenizer.save_pretrained(target)
"""


def build(v1_python: Path | str) -> Path:
    """The model's folder, built under `v1_python` (the V1 environment's) unless present."""
    target = cache.cache_root() / NAME
    if (target / "config.json").exists():
        return target
    source = demo_models.build("tiny-llama-bpe")

    def write(staging: Path) -> None:
        run_v1_script(v1_python, _SCRIPT, (str(source), str(staging)), None, f"building {NAME} in the V1 environment")

    return cache.publish(target, write)
