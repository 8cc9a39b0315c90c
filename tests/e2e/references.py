"""Reference answers outside Triton for the end-to-end tier: offline vLLM, transformers, merged LoRA,
sentence-transformers (the embedding model).

Computed once per session, before any server starts (the `references` fixture, conftest.py), in one
offline vLLM engine and one transformers model per demo model, and cached on disk under the
project's cache folder (`references/`), keyed by the model folder's content digest, the request
spec and the vllm, torch and transformers versions: a later session with the same models and
libraries reads them back. Owns the prompts those references are made for and how each is
computed; knows nothing about servers or what a test asserts.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2

REAL = smollm2.NAME  # SmolLM2-135M-Instruct, the model the shipped repository serves
REAL_LORA = "smollm2-135m-instruct-lora"  # its demo adapters' folder (`pirate`, `shout`)
TINY_BPE = "tiny-llama-bpe"
TINY_SPM = "tiny-llama-spm"
LIBRARIES = ("vllm", "torch", "transformers")

# The real model (test_real_model.py): chats (its ChatML template) and plain text, greedy.
CHATS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
)
PLAIN = ("The quick brown fox", "Once upon a time, there was a", "def fibonacci(n):", "The three primary colours are")
REAL_MAX_TOKENS = 24
REAL_GREEDY = {"temperature": 0, "max_tokens": REAL_MAX_TOKENS}
# The README's LoRA answers (test_lora_real_model.py): this question, greedy, with each adapter merged.
LORA_QUESTION = "What is the capital of France?"
LORA_ADAPTERS = ("pirate", "shout")
LORA_MAX_TOKENS = 24

# The tiny models (test_llm_e2e.py): text prompts, greedy, EOS ignored.
TINY_PROMPTS = ("Hello world, the model", "你好 世界 模型 🚀 café", "people write code", "a")
TINY_MAX_TOKENS = 24
TINY_GREEDY = {"temperature": 0, "max_tokens": TINY_MAX_TOKENS, "ignore_eos": True}
# Prompt logprobs (test_sampling_exactness.py): the first tiny prompt's, its top 3 per position.
TINY_PROMPT_LOGPROBS = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": 3}

# The embedding model (test_embeddings_served.py, test_v1_served.py): sentence-transformers' own encode.
EMBEDDER = "all-minilm-l6-v2"
EMBEDDING_TEXTS = (
    "The food was delicious and the waiter...",  # Triton's OpenAI front end's embedding test
    "你好 世界 🚀 café",
    "a",
    "Multi-step scheduling streams every decoded step; an embedding model pools its prompt once. " * 6,
)

# Triton's vLLM backend, ci/L0_backend_vllm/accuracy_test/accuracy_test.py (r25.01-r25.10):
# GUIDED_PROMPTS, SAMPLING_PARAMETERS and the guided_decoding it adds, per branch
# (test_sampling_exactness.py, on the tiny byte-level model).
THEIR_GUIDED_PROMPTS = ("Classify intent of the sentence: Harry Potter is underrated. ",)
THEIR_SAMPLING_PARAMETERS = {"temperature": 0, "top_p": 1}
THEIR_GUIDED_DECODING = {
    "r25.01-r25.09": {"choice": ["Positive", "Negative"], "backend": "outlines"},
    "r25.10": {"choice": ["Positive", "Negative"]},
}


def chat_ids(tokenizer, question: str) -> list[int]:
    """The prompt ids of a one-message chat, as the preprocessing stage builds them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def real_prompts(tokenizer) -> list[list[int]]:
    """The real model's prompt ids: chats (ChatML template) and plain text (no BOS: the model adds none)."""
    return [chat_ids(tokenizer, q) for q in CHATS] + [tokenizer.encode(p) for p in PLAIN]


@dataclass(frozen=True)
class References:
    """Every reference of the session; lists follow the order of the prompts above."""

    real_offline: list[list[int]]  # offline vLLM greedy ids per real_prompts()
    real_hf: list[list[int]]  # transformers greedy ids per real_prompts()
    lora_merged: dict[str, list[int]]  # adapter → transformers greedy ids with it merged, LORA_QUESTION
    tiny_offline: dict[str, list[tuple[list[int], str]]]  # demo model → offline vLLM (ids, text) per prompt
    tiny_hf_first: dict[str, list[int]]  # demo model → transformers greedy ids of TINY_PROMPTS[0]
    their_guided: dict[str, list[str]]  # branch → offline vLLM `prompt + answer` per THEIR_GUIDED_PROMPTS
    # offline vLLM's prompt logprobs of TINY_PROMPTS[0] with TINY_PROMPT_LOGPROBS (tiny BPE model):
    # per position {token id (text): logprob}, None for the first
    tiny_prompt_logprobs: list[dict[str, float] | None]
    # sentence-transformers' embedding (normalized, float32 values) per EMBEDDING_TEXTS, and its token ids
    embeddings: list[list[float]]
    embedding_ids: list[list[int]]


def cache_folder() -> Path:
    return demo_models.cache_home() / "references"


def library_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in LIBRARIES}  # read without importing them


def _signature(folder: Path) -> list:
    return [[p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file()]  # fmt: skip


def folder_digest(folder: Path) -> str:
    """demo_models.folder_digest, remembered by the files' sizes and times: hashing the real
    model's 0.5 GB each session would cost seconds for nothing."""
    folder = folder.resolve()
    memo_path = cache_folder() / "digests.json"
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    signature = _signature(folder)
    entry = memo.get(str(folder))
    if entry and entry["signature"] == signature:
        return entry["digest"]
    digest = demo_models.folder_digest(folder)
    memo[str(folder)] = {"signature": signature, "digest": digest}
    _write(memo_path, memo)
    return digest


def _write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(value))
    staging.replace(path)  # whole or not at all: a crash mid-write leaves no half reference


def cached(kind: str, folders: list[Path], spec: dict, compute: Callable[[], object]) -> object:
    """`compute()`'s JSON result, from cache/references/ when the folders' contents, `spec` and the
    library versions are those it was computed with."""
    key_source = {
        "kind": kind,
        "folders": [folder_digest(f) for f in folders],
        "spec": spec,
        "libraries": library_versions(),
    }
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_folder() / f"{kind}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())["result"]
    result = compute()
    _write(path, {"key": key_source, "result": result})
    return result


def _offline_vllm(folder: Path, max_model_len: int, requests: list[dict]) -> list[list]:
    """One offline vLLM engine on `folder`, every request ({prompt | prompt_ids, sampling, guided}) in
    one generate call: [token ids, text, prompt logprobs ({token id: logprob} per position, or None)]
    per request."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import GuidedDecodingParams

    llm = LLM(str(folder), dtype="float32", max_model_len=max_model_len, seed=0, enforce_eager=True)
    try:
        prompts = [r["prompt"] if "prompt" in r else TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
        params = [
            SamplingParams(**r["sampling"], **({"guided_decoding": GuidedDecodingParams(**r["guided"])}
                                               if r.get("guided") else {}))
            for r in requests
        ]  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [[list(o.outputs[0].token_ids), o.outputs[0].text, _prompt_logprobs(o)] for o in outputs]
    finally:
        del llm
        gc.collect()


def _prompt_logprobs(output) -> list[dict[str, float] | None] | None:
    if output.prompt_logprobs is None:
        return None
    return [
        None if step is None else {str(token): lp.logprob for token, lp in step.items()}
        for step in output.prompt_logprobs
    ]


def _hf_real(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers greedy, stopping at the model's EOS as its generation config says."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    answers = []
    for ids in prompts:
        tensor = torch.tensor([ids])
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=REAL_MAX_TOKENS,
                             do_sample=False)  # fmt: skip
        answers.append(out[0, len(ids) :].tolist())
    return answers


def _hf_tiny(folder: Path, prompt: str, tokens: int) -> list[int]:
    """transformers greedy on a text prompt (the tokenizer's BOS added), exactly `tokens` of them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def _merged_lora(folder: Path, adapter_dir: Path, ids: list[int]) -> list[int]:
    from triton_vllm_multistep.checks import adapters as lora

    return lora.greedy_ids(lora.merged_model(folder, adapter_dir), ids, LORA_MAX_TOKENS, stop_at_eos=True)


def _sentence_transformers(folder: Path, texts: list[str]) -> list[list[float]]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    vectors = [vector.tolist() for vector in model.encode(texts, convert_to_numpy=True)]
    del model
    gc.collect()
    return vectors


def compute_all() -> References:
    """Every reference, from the cache where it is there, else computed (one engine per model). One
    process at a time (xdist's workers): the second waits, then reads what the first computed."""
    cache_folder().mkdir(parents=True, exist_ok=True)
    with open(cache_folder() / "compute.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _compute_all()


def _compute_all() -> References:
    from transformers import AutoTokenizer

    real = demo_models.build(REAL).resolve()
    real_ids = real_prompts(AutoTokenizer.from_pretrained(real))
    real_requests = [{"prompt_ids": ids, "sampling": REAL_GREEDY} for ids in real_ids]
    real_offline = cached("vllm", [real], {"max_model_len": 2048, "requests": real_requests},
                          lambda: [ids for ids, *_ in _offline_vllm(real, 2048, real_requests)])  # fmt: skip
    real_hf = cached("transformers", [real], {"prompts": real_ids, "max_new_tokens": REAL_MAX_TOKENS},
                     lambda: _hf_real(real, real_ids))  # fmt: skip

    adapters = demo_models.build(REAL_LORA).resolve()
    lora_ids = chat_ids(AutoTokenizer.from_pretrained(real), LORA_QUESTION)
    lora_merged = {
        adapter: cached("merged-lora", [real, adapters / adapter],
                        {"prompt_ids": lora_ids, "max_new_tokens": LORA_MAX_TOKENS, "stop_at_eos": True},
                        lambda adapter=adapter: _merged_lora(real, adapters / adapter, lora_ids))
        for adapter in LORA_ADAPTERS
    }  # fmt: skip

    tiny_offline, tiny_hf_first, their_guided, tiny_prompt_logprobs = {}, {}, {}, []
    for name in (TINY_BPE, TINY_SPM):
        folder = demo_models.build(name).resolve()
        requests = [{"prompt": p, "sampling": TINY_GREEDY} for p in TINY_PROMPTS]
        if name == TINY_BPE:  # their guided-decoding baseline and prompt logprobs ride in the same engine
            requests += [{"prompt": TINY_PROMPTS[0], "sampling": TINY_PROMPT_LOGPROBS}]
            requests += [
                {"prompt": p, "sampling": THEIR_SAMPLING_PARAMETERS, "guided": guided}
                for guided in THEIR_GUIDED_DECODING.values()
                for p in THEIR_GUIDED_PROMPTS
            ]
        outputs = cached("vllm", [folder], {"max_model_len": 1024, "requests": requests},
                         lambda folder=folder, requests=requests: _offline_vllm(folder, 1024, requests))  # fmt: skip
        tiny_offline[name] = [(ids, text) for ids, text, *_ in outputs[: len(TINY_PROMPTS)]]
        if name == TINY_BPE:
            rest = iter(outputs[len(TINY_PROMPTS) :])
            tiny_prompt_logprobs = next(rest)[2]
            for branch in THEIR_GUIDED_DECODING:
                their_guided[branch] = [prompt + next(rest)[1] for prompt in THEIR_GUIDED_PROMPTS]
        tiny_hf_first[name] = cached(
            "transformers", [folder], {"prompt": TINY_PROMPTS[0], "tokens": TINY_MAX_TOKENS},
            lambda folder=folder: _hf_tiny(folder, TINY_PROMPTS[0], TINY_MAX_TOKENS),
        )  # fmt: skip
    embedder = demo_models.build(EMBEDDER).resolve()
    embedding_ids = [AutoTokenizer.from_pretrained(embedder).encode(text) for text in EMBEDDING_TEXTS]
    embeddings = cached("sentence-transformers", [embedder],
                        {"texts": EMBEDDING_TEXTS, "version": metadata.version("sentence-transformers")},
                        lambda: _sentence_transformers(embedder, list(EMBEDDING_TEXTS)))  # fmt: skip
    return References(
        real_offline,
        real_hf,
        lora_merged,
        tiny_offline,
        tiny_hf_first,
        their_guided,
        tiny_prompt_logprobs,
        embeddings,
        embedding_ids,
    )
