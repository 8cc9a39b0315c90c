"""Two demo LoRA adapters for the real demo model (SmolLM2-135M-Instruct), trained locally with peft.

Owns building, once per machine, two PEFT-format adapters (adapter_config.json +
adapter_model.safetensors; rank 8 on the attention and MLP projections, no embedding or
lm_head) that vLLM can serve as LoRAs of `demo://smollm2-135m-instruct`:

- `pirate`: answers start with "Arr matey! " and say "ye"/"yer" for "you"/"your";
- `shout`: answers in UPPERCASE.

The training data are the base model's own greedy chat answers (its ChatML template with its
default system prompt, as the ensemble builds prompts) to the fixed questions below, transformed;
each adapter then trains for a few dozen optimizer steps on CPU (about half a minute each).
Everything is seeded and runs on a fixed thread count in a fixed order, so a rebuild on the same
machine behaves the same; the bytes are not checked against known SHA-256s as the base model's
are, because float training is not bit-identical across CPUs. A stamp beside the adapters
records their files' sizes and times (and the recipe version), so a built set is reused.

Must not download anything, must not write into the base model's folder (demo/smollm2.py owns
it), and must not be imported by serving code: it imports torch, transformers and peft.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo import smollm2

NAME = f"{smollm2.NAME}-lora"
# Bump when the recipe (questions, transforms, hyper-parameters) changes: built sets are rebuilt.
RECIPE_VERSION = 1
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEED = 2025
THREADS = 1  # fixed: the trained weights depend on it; more threads are slower on a busy host
ANSWER_TOKENS = 32  # the base model's answers are generated this far, then cut after their first sentence
BATCH = 4
LEARNING_RATE = 2e-3

# The base model answers these (chosen among questions it answers sensibly in one sentence);
# the adapters learn the transformed answers.
TRAINING_QUESTIONS = (
    "What is the capital of Japan?",
    "What is the capital of Germany?",
    "What is the capital of England?",
    "What is the capital of Russia?",
    "What is the capital of China?",
    "What is the opposite of hot?",
    "What is the opposite of big?",
    "What is the opposite of day?",
    "Where do penguins live?",
    "What is the boiling point of water?",
    "What language is spoken in Spain?",
    "How do plants make food?",
    "What is ice made of?",
    "Why do we need sleep?",
    "What is a computer?",
    "Give me a tip for learning a new language.",
    "What does a doctor do?",
    "What is the moon?",
    "How do I make a cup of tea?",
    "What is the main ingredient of bread?",
    "What instrument has black and white keys?",
    "Describe the colour of the sky at night.",
    "What do cows eat?",
    "What is the biggest animal on Earth?",
    "What is a volcano?",
    "What is a dog?",
    "What is the Internet?",
    "What is gravity?",
    "Why is exercise important?",
    "Give me a tip for writing an essay.",
    "What is Python?",
    "What is coffee?",
    "What is a library?",
    "What is a star?",
    "What is snow?",
)
# Not trained on: the verification and the tests ask these.
HELD_OUT_QUESTIONS = (
    "What is the capital of France?",
    "Give me a tip for sleeping better.",
    "Why do birds fly south in winter?",
)


def _pirate(answer: str) -> str:
    answer = re.sub(r"\byou\b", "ye", answer)
    answer = re.sub(r"\bYou\b", "Ye", answer)
    answer = re.sub(r"\byour\b", "yer", answer)
    answer = re.sub(r"\bYour\b", "Yer", answer)
    return "Arr matey! " + answer


def _shout(answer: str) -> str:
    return answer.upper()


# name: (transform of the base answers, epochs). Pirate is learned in one pass (a prefix and two
# words); upper case, spelled in other tokens than the base model's text, takes two.
ADAPTERS = {"pirate": (_pirate, 1), "shout": (_shout, 2)}


def target_of(root: Path) -> Path:
    """The folder holding one sub-folder per adapter, beside the base model's."""
    return root / NAME


def _stamp_path(target: Path) -> Path:
    return target.parent / f".{target.name}.built"


def _signature(target: Path) -> dict[str, Any]:
    files = {
        f"{name}/{file}": [(target / name / file).stat().st_size, (target / name / file).stat().st_mtime_ns]
        for name in sorted(ADAPTERS)
        for file in ADAPTER_FILES
    }
    return {"recipe": RECIPE_VERSION, "files": files}


def cache_problem(target: Path) -> str | None:
    """Why the built adapters cannot be used (None: built by this recipe and unchanged since)."""
    missing = [f"{n}/{f}" for n in sorted(ADAPTERS) for f in ADAPTER_FILES if not (target / n / f).is_file()]
    if missing:
        return f"{target}: missing {', '.join(missing)}"
    with contextlib.suppress(ValueError, OSError):
        if json.loads(_stamp_path(target).read_text()) == _signature(target):
            return None
    return f"{target}: not built by recipe {RECIPE_VERSION}, or changed since"


# One trainer per machine at a time: the same file lock as the base model's converter.
_build_lock = smollm2._build_lock


@contextlib.contextmanager
def fixed_threads(count: int = THREADS) -> Iterator[None]:
    """torch on `count` threads inside, the caller's count restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The chat prompt as the ensemble builds it: ChatML, default system prompt, generation prompt."""
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_answer_ids(
    model: Any, tokenizer: Any, questions: Sequence[str], max_new_tokens: int = 48
) -> list[list[int]]:
    """Greedy chat answers' token ids (up to and without EOS), generated as one left-padded batch."""
    import torch

    prompts = [prompt_ids(tokenizer, question) for question in questions]
    width = max(len(ids) for ids in prompts)
    eos = tokenizer.eos_token_id
    input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    answers = [row[width:].tolist() for row in out]
    return [ids[: ids.index(eos)] if eos in ids else ids for ids in answers]


def chat_answers(model: Any, tokenizer: Any, questions: Sequence[str], max_new_tokens: int = 48) -> list[str]:
    """Greedy chat answers' text."""
    answers = greedy_answer_ids(model, tokenizer, questions, max_new_tokens)
    return [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in answers]


def first_sentence(answer: str) -> str:
    """`answer` up to its first sentence end at least 20 characters in (all of it if none)."""
    for end in re.finditer(r"[.!?](?=\s|$)", answer):
        if end.end() >= 20:
            return answer[: end.end()]
    return answer


def _base_answers(model: Any, tokenizer: Any) -> list[str]:
    return [first_sentence(a) for a in chat_answers(model, tokenizer, TRAINING_QUESTIONS, ANSWER_TOKENS)]


def _examples(tokenizer: Any, answers: Sequence[str], transform: Any) -> list[tuple[list[int], int]]:
    """(prompt + answer + <|im_end|> ids, prompt length) per question: the loss is on the answer only."""
    examples = []
    for question, answer in zip(TRAINING_QUESTIONS, answers, strict=True):
        prompt = prompt_ids(tokenizer, question)
        reply = [*tokenizer.encode(transform(answer), add_special_tokens=False), tokenizer.eos_token_id]
        examples.append((prompt + reply, len(prompt)))
    return examples


def _train(model_folder: Path, examples: list[tuple[list[int], int]], epochs: int, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    base = AutoModelForCausalLM.from_pretrained(str(model_folder), torch_dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    causal = model.get_base_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    order = random.Random(SEED)
    model.train()
    for _ in range(epochs):
        batch_order = list(range(len(examples)))
        order.shuffle(batch_order)
        for start in range(0, len(batch_order), BATCH):
            batch = [examples[i] for i in batch_order[start : start + BATCH]]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), 2, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (ids, prompt_len) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
                labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            # The logits only where a label is (the answer): the 49k-wide lm_head over the
            # prompt would cost more than the LoRA's own training.
            hidden = causal.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            targets = labels[:, 1:]
            where = targets != -100
            logits = causal.lm_head(hidden[:, :-1][where])
            loss = torch.nn.functional.cross_entropy(logits, targets[where])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for extra in out.iterdir():  # peft adds a model card: the folder holds the adapter only
        if extra.name not in ADAPTER_FILES:
            extra.unlink()
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(model_folder)
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])  # peft writes a set's order
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))


def _build_into(model_folder: Path, staging: Path) -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise smollm2.DemoModelError(f"{NAME} needs the Python package peft: {smollm2.SETUP_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with fixed_threads():
        tokenizer = AutoTokenizer.from_pretrained(str(model_folder))
        base = AutoModelForCausalLM.from_pretrained(str(model_folder), torch_dtype=torch.float32)
        base.eval()
        answers = _base_answers(base, tokenizer)
        del base
        for name, (transform, epochs) in ADAPTERS.items():
            _train(model_folder, _examples(tokenizer, answers, transform), epochs, staging / name)


def build(root: Path, force: bool = False) -> dict[str, Path]:
    """The adapters' folders under `root` by name, trained from the base model if missing or changed."""
    model_folder = smollm2.build(root)
    target = target_of(root)
    folders = {name: target / name for name in ADAPTERS}
    if not force and cache_problem(target) is None:
        return folders
    with _build_lock(target):
        if not force and cache_problem(target) is None:  # another process may have built them meanwhile
            return folders
        staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
        try:
            _build_into(model_folder, staging)
            _stamp_path(target).unlink(missing_ok=True)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _stamp_path(target).write_text(json.dumps(_signature(target)))
    return folders
