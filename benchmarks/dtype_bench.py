"""CPU dtype for the real demo model: float32 against bfloat16 in offline vLLM, measured interleaved.

Prints decode tokens/s at batch 1/8/32, each engine process's resident memory, and whether each
dtype's greedy tokens match Hugging Face transformers' float32 greedy tokens. Both engines live
in processes of their own and run turn about, so load from other processes on a shared CPU
falls on both alike.

    PYTHONPATH=backend .venv/bin/python benchmarks/dtype_bench.py [--rounds 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

DTYPES = ("float32", "bfloat16")
BATCHES = (1, 8, 32)
CHECK_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "How do I boil an egg?"}],
    "The quick brown fox",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colours are",
]


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def engine_worker(dtype: str, path: str, max_tokens: int, check_tokens: int, conn: Connection) -> None:
    """One vLLM engine of `dtype`; answers ("run", batch) with seconds and ("greedy",) with token ids."""
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # 32 streams of ~80 tokens need ~0.1 GiB
    import psutil
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=path, dtype=dtype, max_model_len=2048, seed=0, disable_log_stats=True)
    tokenizer = llm.get_tokenizer()
    conn.send({"rss_gb": psutil.Process().memory_info().rss / 1e9})
    filler = tokenizer.encode("Tell me a long story about a lighthouse keeper and the sea.")
    while True:
        message = conn.recv()
        if message[0] == "run":
            prompts = [TokensPrompt(prompt_token_ids=filler) for _ in range(message[1])]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            conn.send({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
        elif message[0] == "greedy":
            prompts = [TokensPrompt(prompt_token_ids=_prompt_ids(tokenizer, p)) for p in CHECK_PROMPTS]
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=check_tokens), use_tqdm=False)
            conn.send([list(o.outputs[0].token_ids) for o in outputs])
        else:
            conn.send({"rss_gb": psutil.Process().memory_info().rss / 1e9})
            return


def hf_greedy(path: str, check_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    results = []
    for prompt in CHECK_PROMPTS:
        ids = torch.tensor([_prompt_ids(tokenizer, prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=check_tokens, do_sample=False, pad_token_id=2
        )
        results.append(out[0, ids.shape[1] :].tolist())
    return results


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream in the speed runs")
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with HF per prompt")
    args = parser.parse_args()
    from triton_vllm_multistep.demo import models as demo_models
    from triton_vllm_multistep.demo import smollm2

    path = str(demo_models.build(smollm2.NAME))
    print(f"model {path}; cpu count {os.cpu_count()}; {args.rounds} rounds of {args.max_tokens} tokens per stream")
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    print("CPU flags: " + " ".join(f"{flag}={flag in flags}" for flag in ("avx512f", "avx512_bf16", "amx_bf16")))
    context = mp.get_context("spawn")
    workers: dict[str, tuple[mp.Process, Connection]] = {}
    loaded: dict[str, dict] = {}
    for dtype in DTYPES:  # one at a time: loading is the most memory- and CPU-hungry part
        parent, child = context.Pipe()
        worker_args = (dtype, path, args.max_tokens, args.check_tokens, child)
        process = context.Process(target=engine_worker, args=worker_args, daemon=True)
        process.start()
        workers[dtype] = (process, parent)
        loaded[dtype] = parent.recv()
    try:
        for _, conn in workers.values():
            conn.send(("run", 1))  # warm-up
            conn.recv()
        rates: dict[tuple[str, int], list[float]] = {(d, b): [] for d in DTYPES for b in BATCHES}
        for round_index in range(args.rounds):
            for batch in BATCHES:
                order = DTYPES if round_index % 2 == 0 else DTYPES[::-1]
                for dtype in order:
                    conn = workers[dtype][1]
                    conn.send(("run", batch))
                    result = conn.recv()
                    rates[(dtype, batch)].append(result["tokens"] / result["seconds"])
                    rate = rates[(dtype, batch)][-1]
                    print(f"  round {round_index + 1}, batch {batch:>2}, {dtype:>8}: {rate:7.1f} tok/s", flush=True)
        greedy = {}
        for dtype, (_, conn) in workers.items():
            conn.send(("greedy",))
            greedy[dtype] = conn.recv()
        final_rss = {}
        for dtype, (process, conn) in workers.items():
            conn.send(("stop",))
            final_rss[dtype] = conn.recv()["rss_gb"]
            process.join(60)
    finally:
        for process, _ in workers.values():
            if process.is_alive():
                process.kill()
    reference = hf_greedy(path, args.check_tokens)

    print("\ndecode tokens/s (median of rounds; all streams together):")
    print("  batch " + "".join(f"{dtype:>12}" for dtype in DTYPES) + "   bf16/fp32")
    for batch in BATCHES:
        medians = [statistics.median(rates[(dtype, batch)]) for dtype in DTYPES]
        ratio = medians[1] / medians[0]
        print(f"  {batch:>5} " + "".join(f"{value:>12.1f}" for value in medians) + f"   {ratio:>9.2f}")
    print("\nengine process RSS (GB), after load / at the end:")
    for dtype in DTYPES:
        print(f"  {dtype:>9}: {loaded[dtype]['rss_gb']:.2f} / {final_rss[dtype]:.2f}")
    print(f"\ngreedy tokens ({len(CHECK_PROMPTS)} prompts, {args.check_tokens} tokens) against HF transformers fp32:")
    for dtype in DTYPES:
        diffs = [first_difference(ours, ref) for ours, ref in zip(greedy[dtype], reference, strict=True)]
        same = sum(d is None for d in diffs)
        where = ", ".join(f"prompt {i}: token {d}" for i, d in enumerate(diffs) if d is not None)
        print(f"  {dtype:>9}: {same}/{len(diffs)} identical" + (f" (first difference: {where})" if where else ""))


if __name__ == "__main__":
    main()
