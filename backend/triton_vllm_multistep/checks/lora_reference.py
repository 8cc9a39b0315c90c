"""The LoRA section's adapters and references: which adapters to use, and when the merged reference can run.

Owns parsing --lora-adapters, deciding whether adapters can be constructed for the model and
whether transformers can run the merged-weights reference, and judging tokens against it; must
not build a vLLM engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LORA_CHECKS = (
    "LoRA: base and adapters mixed in one batch each give their tokens alone",
    "LoRA: base and adapters mixed give the tokens of num_scheduler_steps 1",
    "LoRA: each adapter changes the base model's answer",
    "LoRA: greedy tokens equal transformers with the adapter merged into the weights",
)
LORA_RANK = 8
CONSTRUCTED_ADAPTERS = {
    "smoke-attention": (1, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "smoke-mlp": (2, ("gate_proj", "up_proj", "down_proj", "q_proj")),
}
LLAMA_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)
LORA_MAX_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
TRANSFORMERS_MAX_PARAMS = 2_000_000_000  # the merged-weights reference runs in float32 on the host below this
NEAR_TIE_NATS = 0.5  # a bfloat16/float16 engine against the float32 reference: what counts as a near-tie


def parse_lora_adapters(text: str) -> list[tuple[str, Path]]:
    """`--lora-adapters name=path,name=path`: (name, folder) of each, in order; ValueError naming
    what is wrong (a folder without adapter_config.json is not a PEFT adapter)."""
    adapters: list[tuple[str, Path]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, separator, folder = item.partition("=")
        name, folder = name.strip(), folder.strip()
        if not separator or not name or not folder:
            raise ValueError(f"--lora-adapters: {item!r} is not name=path")
        if name in (existing for existing, _ in adapters):
            raise ValueError(f"--lora-adapters: the name {name!r} is given twice")
        path = Path(folder).expanduser().resolve()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"--lora-adapters: {name}: {path} has no adapter_config.json (not a PEFT adapter folder)")
        adapters.append((name, path))
    if not adapters:
        raise ValueError("--lora-adapters names no adapter (name=path,name=path)")
    return adapters


def _adapter_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "adapter_config.json").read_text())


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of the model's safetensors checkpoint, from the files' headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def no_constructed_adapters(model: str, model_dir: Path | None) -> str | None:
    """Why checks/adapters.write_adapter cannot construct adapters for the model under test (None: it can)."""
    from triton_vllm_multistep.checks import adapters as lora

    bring = "; bring adapters of the model with --lora-adapters name=path,name=path"
    if model_dir is None:
        return f"the model {model!r} has no local folder to construct adapters from{bring}"
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return f"{model_dir} has no config.json to construct adapters from{bring}"
    config = json.loads(config_file.read_text())
    missing = [name for name in LLAMA_CONFIG_FIELDS if not isinstance(config.get(name), int)]
    if missing:
        return (
            f"not a Llama-style model ({', '.join(config.get('architectures') or ['no architectures'])}): its "
            f"config.json lacks {', '.join(missing)}, which constructed adapters need{bring}"
        )
    shapes = _checkpoint_shapes(model_dir)
    if not shapes:
        return f"{model_dir} has no safetensors checkpoint to check constructed adapters against{bring}"
    weights = [
        f"model.layers.0.{'self_attn' if name in lora.ATTENTION else 'mlp'}.{name}.weight"
        for name in (*lora.ATTENTION, *lora.MLP)
    ]
    absent = [weight for weight in weights if weight not in shapes]
    if absent:
        return f"not a Llama-style checkpoint: {model_dir} has no {', '.join(absent)}{bring}"
    return None


def no_merged_reference(model_dir: Path | None, adapters: Sequence[tuple[str, Path]], choice: str) -> str | None:
    """Why the transformers reference with each adapter merged (testing/lora.merged_model) cannot run
    here (None: it can). `choice`: --lora-transformers (auto: models below TRANSFORMERS_MAX_PARAMS)."""
    if choice == "off":
        return "--lora-transformers off"
    if model_dir is None:
        return "the model has no local folder for transformers to load"
    if not (model_dir / "model.safetensors").is_file():
        return f"the merged reference reads one model.safetensors, which {model_dir} does not have (sharded or .bin)"
    for name, folder in adapters:
        config = _adapter_config(folder)
        unusual = [key for key in ("use_dora", "use_rslora", "modules_to_save") if config.get(key)]
        if unusual or not (folder / "adapter_model.safetensors").is_file():
            what = ", ".join(unusual) or "no adapter_model.safetensors"
            return f"adapter {name}: {what} (the merged reference merges plain LoRA pairs, W + alpha/r * B @ A)"
    parameters = sum(math.prod(shape) for shape in _checkpoint_shapes(model_dir).values())
    if choice == "auto" and parameters >= TRANSFORMERS_MAX_PARAMS:
        return (
            f"{parameters / 1e9:.1f}B parameters: too large to run in transformers on the host (auto runs models "
            f"below {TRANSFORMERS_MAX_PARAMS / 1e9:.0f}B; --lora-transformers on runs it anyway)"
        )
    return None


def merged_verdict(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], tokens: list[int], exact: bool
) -> tuple[bool, str]:
    """Whether the engine's greedy `tokens` are transformers' (float32, on the host) with `adapter_dir`
    merged into the weights. `exact` (a float32 engine): token for token. Otherwise (bfloat16/float16
    kernels against float32) equal tokens pass, and where they part, every engine token must be a near-tie
    of the merged model's best along the engine's own sequence (within NEAR_TIE_NATS of its log-probability)."""
    import torch

    from triton_vllm_multistep.checks import adapters as lora

    model = lora.merged_model(model_dir, adapter_dir)
    expected = lora.greedy_ids(model, prompt, len(tokens))
    if tokens == expected:
        return True, f"{len(tokens)} tokens equal"
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), len(expected))
    differ = (
        f"differ from token {first} (engine {tokens[first : first + 4]}, transformers {expected[first : first + 4]})"
    )
    if exact or not tokens:
        return False, differ
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logprobs = logits.double().log_softmax(-1)
    gaps = (logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]).tolist()
    worst = max(gaps)
    return worst <= NEAR_TIE_NATS, (
        f"{differ}; along the engine's tokens each is within {worst:.3f} nats of the merged model's best "
        f"(near-tie limit {NEAR_TIE_NATS} for a non-float32 engine)"
    )
