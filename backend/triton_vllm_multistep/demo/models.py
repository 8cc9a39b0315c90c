"""Deterministic local demo models: tiny random-weight Llamas with locally trained tokenizers.

Owns naming the demo models `demo://NAME` and building one by name: the tiny Llamas
(demo/tiny_llama.py), the tiny LLaVA (demo/tiny_llava.py), the real one (SmolLM2-135M-Instruct,
demo/smollm2.py) and its adapters, the embedding model (all-MiniLM-L6-v2, demo/minilm.py); must
not download. Imports run one way: the builders import
demo/cache.py (and tiny_llava the tiny Llama it extends), never this module.
"""

from __future__ import annotations

from pathlib import Path

from triton_vllm_multistep.demo import minilm, smollm2, smollm2_adapters, tiny_llama, tiny_llava
from triton_vllm_multistep.demo.cache import BUILD_VERSION, cache_home, cache_root, folder_digest, publish
from triton_vllm_multistep.demo.tiny_llama import DEMO_MODELS, DemoSpec

# What callers read here (the cache and the tiny Llamas' specs live in their own modules).
__all__ = [
    "BUILD_VERSION",
    "DEMO_MODELS",
    "DEMO_SCHEME",
    "DemoSpec",
    "all_names",
    "build",
    "cache_home",
    "cache_root",
    "folder_digest",
    "publish",
    "resolve",
]
DEMO_SCHEME = "demo://"


def all_names() -> list[str]:
    """Every demo model: the tiny random-weight ones (LLaVA last), the real one, its LoRA adapters, then
    the embedding model."""
    return [*sorted(DEMO_MODELS), tiny_llava.NAME, smollm2.NAME, smollm2_adapters.NAME, minilm.NAME]


def build(name: str, root: Path | None = None, force: bool = False) -> Path:
    """Build demo model `name` under `root` (default: the cache) unless present; return its folder.

    For the SmolLM2 adapters (demo/smollm2_adapters.py) that is the folder of one folder per adapter.
    """
    if name == tiny_llava.NAME:
        return tiny_llava.build(root or cache_root(), force=force)
    if name == smollm2.NAME:
        return smollm2.build(root or cache_root(), force=force)
    if name == minilm.NAME:
        return minilm.build(root or cache_root(), force=force)
    if name == smollm2_adapters.NAME:
        smollm2_adapters.build(root or cache_root(), force=force)
        return smollm2_adapters.target_of(root or cache_root())
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(all_names())}")
    return tiny_llama.build(name, root or cache_root(), force=force)


def resolve(reference: str) -> str:
    """Map `demo://NAME` to its built folder (building it if needed); other references unchanged."""
    if not reference.startswith(DEMO_SCHEME):
        return reference
    return str(build(reference.removeprefix(DEMO_SCHEME)))
