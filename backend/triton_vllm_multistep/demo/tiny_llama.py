"""The tiny random-weight demo Llamas: locally trained tokenizers (byte-level BPE, metaspace), seeded weights.

Owns their specs and building one (same seed, same bytes); must not download. demo/models.py
names them `demo://NAME` beside the other demo models.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from triton_vllm_multistep.demo.cache import publish

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


def build(name: str, root: Path, force: bool = False) -> Path:
    """Build the tiny demo Llama `name` (DEMO_MODELS) under `root` unless present; return its folder."""
    spec = DEMO_MODELS[name]
    target = root / name
    if (target / "model.safetensors").exists() and not force:
        return target

    def write(staging: Path) -> None:
        _write_model(spec, staging, _write_tokenizer(spec, staging))

    return publish(target, write)
