"""Offline CPU multi-step benchmark on the demo model: throughput and where each step's time goes.

Owns the offline workload, benchmarks/results/cpu_multistep.json and the printed table; is not a
test and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from vllm import EngineArgs, SamplingParams
from vllm.sampling_params import RequestOutputKind

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.factory import build_engine
from triton_vllm_multistep.testing.step_timing import PHASES, StepTimer, attach, forward_only_ceiling

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_multistep.json"
PROMPTS = (
    "the model streams every token of a response while the engine schedules",
    "cats sleep near warm windows and rivers run to the sea",
    "people write code read books and drink coffee in small cafes",
    "a quick brown fox jumps over lazy dogs under bright stars",
)


def run_batch(
    engine: Any,
    timer: StepTimer,
    batch: int,
    max_tokens: int,
    output_kind: RequestOutputKind = RequestOutputKind.DELTA,
) -> dict[str, Any]:
    """Generate `max_tokens` tokens for each of `batch` requests arriving together.

    DELTA outputs by default, as the Triton backend streams them.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=output_kind)
    timer.reset()
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", PROMPTS[i % len(PROMPTS)], params)
    engine_steps = outputs = 0
    while engine.has_unfinished_requests():
        outputs += len(engine.step())
        engine_steps += 1
    elapsed = time.perf_counter() - start
    phase_ms = {phase: 1000 * timer.seconds[phase] / engine_steps for phase in PHASES}
    step_ms = 1000 * elapsed / engine_steps
    return {
        "tokens_per_s": batch * max_tokens / elapsed,
        "seconds": elapsed,
        "engine_steps": engine_steps,
        "request_outputs": outputs,
        "step_ms": step_ms,
        "phase_ms": phase_ms,
        "other_ms": step_ms - sum(phase_ms.values()),
    }


def benchmark(
    path: str,
    steps_list: list[int],
    batches: list[int],
    max_tokens: int,
    window_steps: list[int],
    output_kind: RequestOutputKind,
    repeats: int,
) -> dict[str, Any]:
    """Each configuration runs `repeats` times and keeps its fastest run: the host is shared,
    and the fastest run is the one least disturbed by other processes."""
    configs: list[dict[str, Any]] = []
    ceilings: dict[int, float] = {}
    runs = [(steps, True) for steps in steps_list] + [(steps, False) for steps in window_steps]
    for steps, per_step in runs:
        args = EngineArgs(
            model=path,
            dtype="float32",
            max_model_len=1024,
            max_num_seqs=max(batches),
            num_scheduler_steps=steps,
            seed=0,
            disable_log_stats=True,
        )
        engine = build_engine(args, stream_mode="step" if per_step else "window")
        timer = attach(engine)
        run_batch(engine, timer, 8, 24)  # warm-up: first-call allocations and kernel selection
        if not ceilings:
            context_len = len(engine.get_tokenizer().encode(PROMPTS[0])) + max_tokens // 2
            for batch in batches:
                ceilings[batch] = max(
                    forward_only_ceiling(engine, batch, context_len=context_len) for _ in range(repeats)
                )
        for batch in batches:
            tries = [run_batch(engine, timer, batch, max_tokens, output_kind) for _ in range(repeats)]
            result = max(tries, key=lambda r: r["tokens_per_s"])
            result["tokens_per_s_all_runs"] = [r["tokens_per_s"] for r in tries]
            configs.append({"steps": steps, "batch": batch, "outputs": "step" if per_step else "window"} | result)
            print(
                f"steps={steps:2d} outputs={'step' if per_step else 'window'} batch={batch:2d}: "
                f"{result['tokens_per_s']:8.1f} tok/s",
                flush=True,
            )
        del engine, timer
        gc.collect()

    baseline = {c["batch"]: c["tokens_per_s"] for c in configs if c["steps"] == 1}
    for config in configs:
        config["vs_steps_1"] = config["tokens_per_s"] / baseline[config["batch"]]
        config["ceiling_tokens_per_s"] = ceilings[config["batch"]]
        config["vs_ceiling"] = config["tokens_per_s"] / ceilings[config["batch"]]
    return {
        "model": "demo://tiny-llama-bpe",
        "max_tokens": max_tokens,
        "output_kind": output_kind.name,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "forward_only_ceiling_tokens_per_s": ceilings,
        "configs": configs,
    }


def print_table(results: dict[str, Any]) -> None:
    short = {
        "schedule": "sched",
        "prepare_inputs": "prep",
        "forward": "fwd",
        "sample": "sample",
        "pythonize": "pyth",
        "output_processing": "outproc",
    }
    header = (
        f"{'steps':>5} {'out':>6} {'batch':>5} {'tok/s':>8} {'vs s=1':>7} {'vs ceil':>7} "
        f"{'ms/step':>8} " + " ".join(f"{short[p]:>7}" for p in PHASES) + f" {'other':>7}"
    )
    print(header)
    print("-" * len(header))
    for c in results["configs"]:
        phases = " ".join(f"{c['phase_ms'][p]:7.2f}" for p in PHASES)
        print(
            f"{c['steps']:>5} {c['outputs']:>6} {c['batch']:>5} {c['tokens_per_s']:8.1f} "
            f"{c['vs_steps_1']:7.3f} {c['vs_ceiling']:7.3f} {c['step_ms']:8.2f} {phases} "
            f"{c['other_ms']:7.2f}"
        )
    ceilings = ", ".join(f"batch {b}: {v:.0f}" for b, v in results["forward_only_ceiling_tokens_per_s"].items())
    print(f"forward-only ceiling (tok/s): {ceilings}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--window-steps",
        type=int,
        nargs="*",
        default=[8],
        help="also run these steps values with outputs once per window (stream_mode 'window')",
    )
    parser.add_argument("--output-kind", choices=["delta", "cumulative"], default="delta")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (best kept)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if 1 not in args.steps:
        parser.error("--steps must include 1 (the baseline)")

    path = str(demo_models.build("tiny-llama-bpe"))
    output_kind = RequestOutputKind[args.output_kind.upper()]
    results = benchmark(path, args.steps, args.batches, args.max_tokens, args.window_steps, output_kind, args.repeats)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
