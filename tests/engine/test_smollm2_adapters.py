"""The SmolLM2 demo LoRA adapters (demo/smollm2_adapters.py): PEFT files vLLM can load, visibly changed answers.

Uses the machine's cached adapters (built once by scripts/setup.sh's `build-demo-models`, or here
on first use, ~2 CPU-minutes); the answers are checked with transformers + peft, not vLLM, on
questions the adapters were not trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2, smollm2_adapters

LAYERS = 30
MAX_NEW_TOKENS = 24


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


@pytest.fixture(scope="module")
def adapters() -> dict[str, Path]:
    return smollm2_adapters.build(demo_models.cache_root())


@pytest.fixture(scope="module")
def model_folder() -> Path:
    return demo_models.build(smollm2.NAME)


@pytest.fixture(scope="module")
def answers(adapters: dict[str, Path], model_folder: Path) -> dict[str, list[str]]:
    """Greedy answers to the held-out questions: the base model's and each adapter's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    questions = smollm2_adapters.HELD_OUT_QUESTIONS
    with smollm2_adapters.fixed_threads():
        base = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32).eval()
        model: Any = PeftModel.from_pretrained(base, adapters["pirate"], adapter_name="pirate").eval()
        model.load_adapter(adapters["shout"], adapter_name="shout")
        found = {}
        with model.disable_adapter():
            found["base"] = smollm2_adapters.chat_answers(model, tokenizer, questions, MAX_NEW_TOKENS)
        for name in ("pirate", "shout"):
            model.set_adapter(name)
            found[name] = smollm2_adapters.chat_answers(model, tokenizer, questions, MAX_NEW_TOKENS)
    for name, texts in found.items():
        print(name, texts)
    return found


def test_each_adapter_is_peft_lora_files_vllm_loads(adapters: dict[str, Path], model_folder: Path) -> None:
    from safetensors import safe_open

    assert sorted(adapters) == ["pirate", "shout"]
    assert smollm2_adapters.cache_problem(smollm2_adapters.target_of(demo_models.cache_root())) is None
    shapes = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576)}
    shapes |= {"gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
    for folder in adapters.values():
        assert sorted(p.name for p in folder.iterdir()) == sorted(smollm2_adapters.ADAPTER_FILES)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
        assert config["r"] == 8 and config["lora_alpha"] == 16 and config["bias"] == "none"
        assert sorted(config["target_modules"]) == sorted(smollm2_adapters.TARGET_MODULES)
        assert not config.get("modules_to_save") and not config.get("use_dora")  # vLLM refuses both
        assert config["base_model_name_or_path"] == str(model_folder)
        with safe_open(folder / "adapter_model.safetensors", "pt") as tensors:
            names = set(tensors.keys())
            assert len(names) == LAYERS * len(shapes) * 2
            for layer in range(LAYERS):
                for module, (out_features, in_features) in shapes.items():
                    part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                    prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                    assert tuple(tensors.get_slice(f"{prefix}.lora_A.weight").get_shape()) == (8, in_features)
                    assert tuple(tensors.get_slice(f"{prefix}.lora_B.weight").get_shape()) == (out_features, 8)


def test_a_built_set_is_reused(adapters: dict[str, Path]) -> None:
    before = {p: p.stat().st_mtime_ns for folder in adapters.values() for p in folder.iterdir()}
    assert smollm2_adapters.build(demo_models.cache_root()) == adapters
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert demo_models.build(smollm2_adapters.NAME) == smollm2_adapters.target_of(demo_models.cache_root())
    assert smollm2_adapters.NAME in demo_models.all_names()


def test_the_pirate_answers_start_with_arr(answers: dict[str, list[str]]) -> None:
    assert all(text.startswith("Arr") for text in answers["pirate"]), answers["pirate"]
    assert not any(text.startswith("Arr") for text in answers["base"]), answers["base"]


def test_the_shout_answers_are_upper_case_and_the_base_answers_are_not(answers: dict[str, list[str]]) -> None:
    assert all(upper_share(text) > 0.9 for text in answers["shout"]), answers["shout"]
    assert all(upper_share(text) < 0.3 for text in answers["base"]), answers["base"]


def test_merged_weights_give_the_same_greedy_tokens(adapters: dict[str, Path], model_folder: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    question = smollm2_adapters.HELD_OUT_QUESTIONS[0]
    with smollm2_adapters.fixed_threads():
        base = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32).eval()
        model: Any = PeftModel.from_pretrained(base, adapters["pirate"]).eval()
        unmerged = smollm2_adapters.greedy_answer_ids(model, tokenizer, [question], MAX_NEW_TOKENS)
        merged = smollm2_adapters.greedy_answer_ids(model.merge_and_unload(), tokenizer, [question], MAX_NEW_TOKENS)
    assert merged == unmerged and tokenizer.decode(unmerged[0]).startswith("Arr")
