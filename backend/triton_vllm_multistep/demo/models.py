"""Deterministic local demo models: tiny random-weight Llamas with locally trained tokenizers.

Owns building and locating the demo model folders (same seed, same bytes) and naming them
`demo://NAME`, the tiny LLaVA (demo/tiny_llava.py) and the real one (SmolLM2-135M-Instruct,
demo/smollm2.py) included; must not download.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Bump when the builder's output changes, so stale caches are rebuilt rather than reused.
BUILD_VERSION = "v1"
DEMO_SCHEME = "demo://"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class DemoSpec:
    """One demo model: its name, tokenizer style and architecture sizes."""

    name: str
    tokenizer_style: str  # "bytelevel" (GPT-2 style BPE) or "metaspace" (Llama/SentencePiece style)
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    seed: int = 1234


DEMO_MODELS: dict[str, DemoSpec] = {
    spec.name: spec
    for spec in (
        DemoSpec("tiny-llama-bpe", "bytelevel"),
        DemoSpec("tiny-llama-spm", "metaspace"),
    )
}

_WORDS = (
    "the model streams every token of a response while the engine schedules several steps "
    "ahead triton serves many clients at once and each request gets its own answer a quick "
    "brown fox jumps over lazy dogs under bright stars in winter light cats sleep near warm "
    "windows rivers run to the sea people write code read books and drink coffee in small "
    "cafes across old cities there are numbers like 1 2 3 42 100 2025 and punctuation too"
).split()
# Multi-byte text, so that some characters become tokens and others stay split across bytes.
_MULTIBYTE = ("你好", "世界", "模型", "推理", "東京", "こんにちは", "😀", "🚀", "café", "naïve", "€", "—")


def cache_home() -> Path:
    """This project's cache folder; TRITON_VLLM_MULTISTEP_CACHE overrides the default."""
    base = os.environ.get("TRITON_VLLM_MULTISTEP_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "triton-vllm-multistep"


def cache_root() -> Path:
    """Folder holding built demo models."""
    return cache_home() / "demo-models" / BUILD_VERSION


def training_corpus(seed: int, lines: int = 6000) -> Iterator[str]:
    """Seeded synthetic text: English words, digits, punctuation, CJK and emoji."""
    rng = random.Random(seed)
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_MULTIBYTE))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice((".", "!", "?", ",", ":"))


def _train_bytelevel(spec: DemoSpec) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(spec.seed), trainer=trainer)
    return json.loads(tokenizer.to_str())


def _train_metaspace(spec: DemoSpec) -> dict:
    """Llama-style: metaspace pre-tokenizer, BPE with byte fallback, <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(byte_tokens),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(spec.seed), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    # Renumber as Llama does: specials, then the 256 byte tokens, then the learned pieces.
    learned = sorted(
        (tok for tok in data["model"]["vocab"] if tok not in SPECIAL_TOKENS),
        key=data["model"]["vocab"].__getitem__,
    )
    ordered = [*SPECIAL_TOKENS, *byte_tokens, *(t for t in learned if t not in byte_tokens)]
    data["model"]["vocab"] = {tok: index for index, tok in enumerate(ordered)}
    for added in data["added_tokens"]:
        added["id"] = data["model"]["vocab"][added["content"]]
    data["pre_tokenizer"] = None
    data["decoder"] = json.loads(
        decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        ).__getstate__()
    )
    return data


def _write_tokenizer(spec: DemoSpec, folder: Path) -> int:
    data = _train_bytelevel(spec) if spec.tokenizer_style == "bytelevel" else _train_metaspace(spec)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    llama_style = spec.tokenizer_style == "metaspace"
    config = {
        "tokenizer_class": "LlamaTokenizerFast" if llama_style else "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": (
            "{% for message in messages %}{{ '<s>' if loop.first else '' }}"
            "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        ),
    }
    if llama_style:
        config["legacy"] = False
        config["add_prefix_space"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1)
    )
    if not llama_style:
        # A byte-level tokenizer has no built-in BOS; add it like Llama does, via a template.
        from tokenizers import Tokenizer, processors

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
        tokenizer.save(str(folder / "tokenizer.json"))
    return len(data["model"]["vocab"])


def _write_model(spec: DemoSpec, folder: Path, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    hidden, inter = spec.hidden_size, spec.intermediate_size
    kv_dim = hidden // spec.num_attention_heads * spec.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, hidden, std=1.0)}
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        std = hidden**-0.5
        tensors.update(
            {
                prefix + "self_attn.q_proj.weight": normal(hidden, hidden, std=std),
                prefix + "self_attn.k_proj.weight": normal(kv_dim, hidden, std=std),
                prefix + "self_attn.v_proj.weight": normal(kv_dim, hidden, std=std),
                prefix + "self_attn.o_proj.weight": normal(hidden, hidden, std=std),
                prefix + "mlp.gate_proj.weight": normal(inter, hidden, std=std),
                prefix + "mlp.up_proj.weight": normal(inter, hidden, std=std),
                prefix + "mlp.down_proj.weight": normal(hidden, inter, std=inter**-0.5),
                prefix + "input_layernorm.weight": torch.ones(hidden),
                prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    tensors["model.norm.weight"] = torch.ones(hidden)
    # A large output scale keeps greedy choices far from ties, so engines agree exactly.
    tensors["lm_head.weight"] = normal(vocab_size, hidden, std=0.5)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=1))


def all_names() -> list[str]:
    """Every demo model: the tiny random-weight ones (LLaVA last), the real one, then its LoRA adapters."""
    from triton_vllm_multistep.demo import smollm2, smollm2_adapters, tiny_llava

    return [*sorted(DEMO_MODELS), tiny_llava.NAME, smollm2.NAME, smollm2_adapters.NAME]


def build(name: str, root: Path | None = None, force: bool = False) -> Path:
    """Build demo model `name` under `root` (default: the cache) unless present; return its folder.

    For the SmolLM2 adapters (demo/smollm2_adapters.py) that is the folder of one folder per adapter.
    """
    from triton_vllm_multistep.demo import smollm2, smollm2_adapters, tiny_llava

    if name == tiny_llava.NAME:
        return tiny_llava.build(root or cache_root(), force=force)
    if name == smollm2.NAME:
        return smollm2.build(root or cache_root(), force=force)
    if name == smollm2_adapters.NAME:
        smollm2_adapters.build(root or cache_root(), force=force)
        return smollm2_adapters.target_of(root or cache_root())
    spec = DEMO_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(all_names())}")
    target = (root or cache_root()) / name
    if (target / "model.safetensors").exists() and not force:
        return target

    def write(staging: Path) -> None:
        _write_model(spec, staging, _write_tokenizer(spec, staging))

    return publish(target, write)


def publish(target: Path, write: Callable[[Path], None]) -> Path:
    """Build a model folder with `write(staging)` beside `target`, then rename it into place.

    Atomic publish: concurrent builders of the same deterministic content cannot clash (a builder
    that finds the folder already published by another keeps that one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(reference: str) -> str:
    """Map `demo://NAME` to its built folder (building it if needed); other references unchanged."""
    if not reference.startswith(DEMO_SCHEME):
        return reference
    return str(build(reference.removeprefix(DEMO_SCHEME)))


def folder_digest(folder: Path) -> str:
    """SHA-256 over every file's name and bytes, to check that two builds are identical."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
