"""Offline benchmark: vLLM's CPU attention with and without IPEX, and prefix caching, on the demo model.

Owns the shared-prefix workloads and the printed comparison (tokens/s, inter-token latency, TTFT with
a shared system prompt, start-up warm-up time, whether token ids match); is not a test and asserts
nothing about speed. Each configuration runs in its own process (IPEX is used by vLLM once importable,
for the whole process), and configurations are interleaved round by round because the CPU is shared.

    PYTHONPATH=$PWD/backend .venv/bin/python benchmarks/ipex_prefix_bench.py [--rounds 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = {
    # name: (IPEX importable, enable_prefix_caching)
    "no-ipex": (False, False),
    "ipex": (True, False),
    "ipex+prefix-cache": (True, True),
}
_BLOCKED = "intel_extension_for_pytorch"


def _block_ipex() -> None:
    """Make `import intel_extension_for_pytorch` fail in this process, as on a host without it.

    The module is still found (transformers only asks whether it exists); loading it raises.
    """
    import importlib.abc
    import importlib.machinery

    class _FailingLoader(importlib.abc.Loader):
        def create_module(self, spec: Any) -> None:
            raise ModuleNotFoundError(f"No module named '{spec.name}' (blocked by the benchmark)")

        def exec_module(self, module: Any) -> None:  # never reached
            raise ModuleNotFoundError(module.__name__)

    class _Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name == _BLOCKED or name.startswith(_BLOCKED + "."):
                return importlib.machinery.ModuleSpec(name, _FailingLoader())
            return None

    sys.meta_path.insert(0, _Blocker())


def _token_ids(vocab: int, count: int, salt: int) -> list[int]:
    span = vocab - 20
    return [20 + (salt * 7919 + i * 104729) % span for i in range(count)]


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    use_ipex, caching = CONFIGS[args.config]
    if not use_ipex:
        _block_ipex()
    os.environ["VLLM_USE_V1"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from triton_vllm_multistep.demo import models as demo_models
    from triton_vllm_multistep.engine.cpu_attention import ipex_available
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.warmup import warm_up

    assert ipex_available() == use_ipex, args.config
    path = str(demo_models.build(args.model))
    started = time.perf_counter()
    engine = build_engine(
        EngineArgs(
            model=path,
            dtype="float32",
            max_model_len=1024,
            num_scheduler_steps=args.steps,
            enable_prefix_caching=caching,
            seed=0,
            disable_log_stats=True,
        )
    )
    build_seconds = time.perf_counter() - started
    warmup_seconds = warm_up(engine).seconds
    vocab = engine.model_config.get_vocab_size()

    def generate(prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[dict[str, list[float]], list[int]]:
        """All prompts at once; per request the wall time of each output (DELTA, one per step)."""
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        times: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        submitted = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
            times[f"{tag}-{i}"] = [submitted]
            tokens[f"{tag}-{i}"] = []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.outputs[0].token_ids:
                    times[out.request_id].append(now)
                    tokens[out.request_id] += list(out.outputs[0].token_ids)
        flat = [t for rid in sorted(tokens) for t in tokens[rid]]
        return times, flat

    # Throughput: 32 prompts sharing a ~120-token prefix, 64 new tokens each, all at once.
    prefix = _token_ids(vocab, 120, salt=1)
    engine.reset_prefix_cache()
    batch = [prefix + _token_ids(vocab, 8, salt=100 + i) for i in range(32)]
    started = time.perf_counter()
    times, batch_tokens = generate(batch, 64, "batch")
    batch_seconds = time.perf_counter() - started
    gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts[1:])]
    # TTFT: chat-like requests sharing a long system prompt, one at a time (the first fills the cache).
    system = _token_ids(vocab, args.system_tokens, salt=2)
    engine.reset_prefix_cache()
    ttfts: list[float] = []
    chat_tokens: list[int] = []
    for i in range(args.chat_requests):
        times, tokens = generate([system + _token_ids(vocab, 24, salt=300 + i)], 16, f"chat{i}")
        ttfts.extend(ts[1] - ts[0] for ts in times.values())
        chat_tokens += tokens
    return {
        "config": args.config,
        "build_s": build_seconds,
        "warmup_s": warmup_seconds,
        "tokens_per_s": len(batch_tokens) / batch_seconds,
        "itl_median_ms": 1000 * statistics.median(gaps),
        "itl_p90_ms": 1000 * statistics.quantiles(gaps, n=10)[-1],
        "ttft_first_ms": 1000 * ttfts[0],
        "ttft_later_median_ms": 1000 * statistics.median(ttfts[1:]),
        "digest_batch": hashlib.sha256(json.dumps(batch_tokens).encode()).hexdigest()[:12],
        "digest_chat": hashlib.sha256(json.dumps(chat_tokens).encode()).hexdigest()[:12],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="tiny-llama-bpe", help="demo model name (demo://NAME)")
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--chat-requests", type=int, default=6)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", dest="config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    names = args.configs.split(",")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:  # interleaved: each round runs every configuration once
            command = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps), "--model", args.model]
            command += ["--system-tokens", str(args.system_tokens), "--chat-requests", str(args.chat_requests)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} failed (exit {done.returncode})")
            result = json.loads(lines[-1][len("RESULT ") :])
            results[name].append(result)
            print(f"round {round_index + 1} {name}: " + json.dumps(result), flush=True)
    baseline = names[0]

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"\nmodel demo://{args.model}, num_scheduler_steps={args.steps}, medians of {args.rounds} interleaved rounds")
    header = (
        f"{'config':<20}{'tok/s':>9}{'x':>7}{'ITL med ms':>12}{'ITL p90 ms':>12}"
        f"{'TTFT 1st ms':>13}{'TTFT later ms':>15}{'warm-up s':>11}{'build s':>9}  same tokens"
    )
    print(header)
    for name in names:
        same = all(
            r["digest_batch"] == results[baseline][0]["digest_batch"]
            and r["digest_chat"] == results[baseline][0]["digest_chat"]
            for r in results[name]
        )
        print(
            f"{name:<20}{median(name, 'tokens_per_s'):>9.0f}"
            f"{median(name, 'tokens_per_s') / median(baseline, 'tokens_per_s'):>7.2f}"
            f"{median(name, 'itl_median_ms'):>12.1f}{median(name, 'itl_p90_ms'):>12.1f}"
            f"{median(name, 'ttft_first_ms'):>13.1f}{median(name, 'ttft_later_median_ms'):>15.1f}"
            f"{median(name, 'warmup_s'):>11.2f}{median(name, 'build_s'):>9.1f}  {'yes' if same else 'NO'}"
        )


if __name__ == "__main__":
    main()
