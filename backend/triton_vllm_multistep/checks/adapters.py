"""LoRA adapters for the GPU smoke check, tests and benchmarks: constructed deterministically in
PEFT's format, and the merged-weights reference outside vLLM.

Owns writing an adapter (adapter_config.json + adapter_model.safetensors, the files vLLM and PEFT
load) from a seed for a local Llama-style model, and the merged model `W + (alpha / r) * B @ A`
that transformers runs as the reference; must not be imported by serving code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama-style layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def write_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] = ATTENTION,
    strength: float = 1.0,
) -> Path:
    """A PEFT LoRA adapter for `model_dir` with N(0, strength/sqrt(fan_in)) A and B, from `seed`."""
    config = json.loads((model_dir / "config.json").read_text())
    shapes = _module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in target_modules:
            out_features, in_features = shapes[name]
            block = "self_attn" if name in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(rank, in_features, generator=generator) * (strength / in_features**0.5)
            b = torch.randn(out_features, rank, generator=generator) * (strength / rank**0.5)
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out_dir


def write_biased_adapter(model_dir: Path, out_dir: Path, *, seed: int) -> Path:
    """An adapter whose config asks for a bias (`bias: all`) vLLM does not serve: only vLLM's own load
    of it refuses it (the load-error tests of both engines)."""
    write_adapter(model_dir, out_dir, seed=seed)
    config = json.loads((out_dir / "adapter_config.json").read_text())
    (out_dir / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    return out_dir


def merged_state_dict(model_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights with the adapter merged in: W + (lora_alpha / r) * B @ A (PEFT's merge)."""
    state = load_file(str(model_dir / "model.safetensors"))
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        weight = f"{module}.weight"
        state[weight] = state[weight] + scale * (b.double() @ a.double()).to(state[weight].dtype)
    return state


def merged_model(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """transformers' model for `model_dir`, with `adapter_dir` merged into its weights (None: the base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model.load_state_dict(merged_state_dict(model_dir, adapter_dir), strict=False)
    return model.eval()


def greedy_ids(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> list[int]:
    """Greedy continuation token ids of `prompt_ids`: `max_new_tokens` of them, or up to and with the
    model's EOS token with `stop_at_eos` (as vLLM returns a finished sequence)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=None if stop_at_eos else max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
