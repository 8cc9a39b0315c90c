"""Multi-LoRA on the CPU engine (issue #23): tokens/s of a batch spread over 1 / 2 / 4 adapters against
the base model alone, at num_scheduler_steps 8 and 1 (figures, not a test; asserts nothing about speed).

For each model (SmolLM2-135M-Instruct, float32, and the overhead-bound demo `tiny-llama-bpe`) and
steps 8 and 1, two engines (engine/factory.py build_engine, stream_mode "step"): one without LoRA
and one with LoRA enabled (max_loras 4, max_cpu_loras 4, max_lora_rank 8, so four adapters fit in
one batch). Four rank-8 adapters on every attention and MLP projection are constructed in PEFT's
format (checks/adapters.py, seeds 1-4). A batch of N concurrent requests (default 32; distinct
prompts, greedy, `ignore_eos`, the same max_tokens) is added at once and driven by engine.step()
until all finish, request i getting the i-th (round robin) of its configuration's adapters:

- `base, no LoRA`: the base model on the engine without LoRA (the reference of every ratio);
- `base, LoRA on`: the base model alone on the engine with LoRA (what LoRA layers cost base requests);
- `1 adapter`, `2 adapters`, `4 adapters`: the batch spread evenly over them;
- `base + 4 adapters`: the batch spread over the base model and the four adapters.

Reported per configuration and steps: generated tokens/s (all tokens over the batch's wall time, from
adding the requests to the last token, prefill included), the median time per output token (per
request, first to last token over the tokens after the first) and time to first token; tokens/s
against `base, no LoRA` at the same steps, and steps 8 / steps 1. Then, per engine step, where the
time goes: the forward pass and, inside it, vLLM's punica ops (the LoRA wrapper's add_lora_linear /
add_lora_logits / add_lora_embedding, timed on the instance), set_active_loras, output processing,
and the process's CPU seconds per 1,000 tokens.

A model's four engines live in one child process (one interpreter, KV caches sized by block count:
a shared host cannot give four engines VLLM_CPU_KVCACHE_SPACE's 1 GiB each), run from its main thread
one at a time, with the served thread policy (engine/factory.py serving_torch_threads) unless
--torch-threads. Every (steps, configuration) pair is measured once per round; odd rounds run in the
reverse order of even ones, so the host's drift falls on every configuration alike (the tiny model's
batches take about a second: it gets --small-model-rounds times the rounds). Figures are medians over
the rounds, ratios medians of the per-round ratios (the best-of-rounds figures are in the JSON). An
unmeasured warm-up round (8 tokens, every pair) loads the adapters first. As checks, the greedy tokens
of steps 8 must equal those of steps 1 for every configuration, the base model's must be the same
with LoRA on as without, and the adapters must change every request's.

    .venv/bin/python -m benchmarks.lora_throughput --torch-threads 1 --rounds 4   # docs/performance.md (~50 min)
    .venv/bin/python -m benchmarks.lora_throughput --quick     # one round, 16 tokens, SmolLM2 only
    .venv/bin/python -m benchmarks.lora_throughput --models tiny-llama-bpe --rounds 4

Results: benchmarks/results/lora_throughput.json (--quick: lora_throughput_quick.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from statistics import median
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = (8, 1)
ADAPTERS = ("lora1", "lora2", "lora3", "lora4")
REFERENCE = "base, no LoRA"
# configuration → (engine has LoRA, what the requests get in turn: None is the base model)
CONFIGS: dict[str, tuple[bool, tuple[str | None, ...]]] = {
    REFERENCE: (False, (None,)),
    "base, LoRA on": (True, (None,)),
    "1 adapter": (True, ADAPTERS[:1]),
    "2 adapters": (True, ADAPTERS[:2]),
    "4 adapters": (True, ADAPTERS),
    "base + 4 adapters": (True, (None, *ADAPTERS)),
}
DEFAULT_MODELS = ("smollm2-135m-instruct", "tiny-llama-bpe")
TOPICS = (
    "a lighthouse keeper",
    "a river that runs uphill",
    "the last bakery in town",
    "a robot learning to paint",
    "two cats and a storm",
    "a train that never stops",
    "a garden on the moon",
    "an old map",
)


def prompt_text(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]} (request {i})."


# ---------------------------------------------------------------------------------------------
# The model's process: its four engines, measured in turn
# ---------------------------------------------------------------------------------------------


class Engine:
    """One engine of the model's process, with its step phases and LoRA parts timed."""

    def __init__(self, model_dir: str, steps: int, lora: bool, adapter_dirs: dict[str, str], args: Any) -> None:
        from vllm import EngineArgs
        from vllm.lora.request import LoRARequest

        from triton_vllm_multistep.engine.factory import build_engine
        from triton_vllm_multistep.testing.step_timing import StepTimer, attach, driver_runner

        lora_args = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 4} if lora else {}
        # A KV cache for the batch with room to spare (VLLM_CPU_KVCACHE_SPACE's 1 GiB minimum per
        # engine, times four engines, is more memory than a shared host should give a benchmark).
        blocks = max(256, 2 * args.batch * -(-(args.max_tokens + 64) // 16))
        engine_args = EngineArgs(
            model=model_dir,
            dtype="float32",
            max_model_len=512,
            num_scheduler_steps=steps,
            seed=0,
            disable_log_stats=True,
            num_gpu_blocks_override=blocks,
            **lora_args,
        )
        started = time.perf_counter()
        self.engine = build_engine(engine_args, stream_mode="step")
        self.build_s = time.perf_counter() - started
        self.tokenizer = self.engine.get_tokenizer()
        self.timer = attach(self.engine)
        # Within those phases: vLLM's punica ops (inside the forward pass) and setting the batch's
        # adapter mapping (before it), on the instances the LoRA layers and the runner call.
        self.lora_timer = StepTimer()
        self.lora_timer.seconds = {"lora_ops": 0.0, "set_active_loras": 0.0}
        runner = driver_runner(self.engine)
        if lora:
            wrapper = runner.lora_manager._adapter_manager.punica_wrapper
            for method in ("add_lora_linear", "add_lora_logits", "add_lora_embedding"):
                setattr(wrapper, method, self.lora_timer.timed("lora_ops", getattr(wrapper, method)))
            runner.set_active_loras = self.lora_timer.timed("set_active_loras", runner.set_active_loras)
        self.requests = {name: LoRARequest(name, i + 1, adapter_dirs[name]) for i, name in enumerate(ADAPTERS)}
        self.runs = 0

    def run(self, batch: int, max_tokens: int, names: tuple[str | None, ...]) -> dict[str, Any]:
        """`batch` requests added at once, request i with the i-th (round robin) of `names`; the figures."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from triton_vllm_multistep.testing.step_timing import PHASES

        engine, timer, lora_timer = self.engine, self.timer, self.lora_timer
        self.runs += 1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode(prompt_text(i))) for i in range(batch)]
        ids = [f"r{self.runs}-{i}" for i in range(batch)]
        times: dict[str, list[float]] = {r: [] for r in ids}
        tokens: dict[str, list[int]] = {r: [] for r in ids}
        engine_steps = 0
        timer.reset()
        lora_timer.seconds = dict.fromkeys(lora_timer.seconds, 0.0)
        cpu_started = time.process_time()
        start = time.perf_counter()
        for i, request_id in enumerate(ids):
            name = names[i % len(names)]
            lora_request = None if name is None else self.requests[name]
            engine.add_request(request_id, prompts[i], params, lora_request=lora_request)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            engine_steps += 1
            for output in outputs:
                new = list(output.outputs[0].token_ids)
                if new:
                    times[output.request_id].append(now)
                    tokens[output.request_id].extend(new)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_started
        generated = sum(len(t) for t in tokens.values())
        tpot = [(t[-1] - t[0]) / (len(tokens[r]) - 1) for r, t in times.items() if len(tokens[r]) > 1]
        return {
            "seconds": seconds,
            "tokens": generated,
            "tokens_per_s": generated / seconds,
            "tpot_ms": 1000 * statistics.median(tpot),
            "ttft_ms": 1000 * statistics.median(t[0] - start for t in times.values()),
            "engine_steps": engine_steps,
            # CPU seconds of the process (every thread) per 1,000 output tokens.
            "cpu_s_per_1k_tokens": 1000 * cpu_seconds / generated,
            # Wall ms per engine step in each phase, and the LoRA parts of them.
            "step_ms": 1000 * seconds / engine_steps,
            "phase_ms": {phase: 1000 * timer.seconds[phase] / engine_steps for phase in PHASES},
            "lora_ms": {part: 1000 * s / engine_steps for part, s in lora_timer.seconds.items()},
            "token_ids": [tokens[r] for r in ids],
        }


def measure_model(model: str, args: argparse.Namespace, adapter_dirs: dict[str, str]) -> dict[str, Any]:
    """The model's figures: its four engines built in this process, then the interleaved rounds."""
    os.environ["VLLM_USE_V1"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the engines' caches are sized by block count
    import torch

    from triton_vllm_multistep.demo import models as demo_models
    from triton_vllm_multistep.engine.cpu_placement import thread_choice_of_user
    from triton_vllm_multistep.engine.factory import serving_torch_threads
    from triton_vllm_multistep.engine.loop import model_parameters

    user_threads = thread_choice_of_user()
    model_dir = str(demo_models.build(model))
    engines: dict[tuple[int, bool], Engine] = {}
    for steps in STEPS:
        for with_lora in (False, True):
            print(f"[{model}] building the steps {steps} engine, LoRA {'on' if with_lora else 'off'}", flush=True)
            engines[(steps, with_lora)] = Engine(model_dir, steps, with_lora, adapter_dirs, args)
    # The served thread policy (engine/loop.py applies it the same way, once the engine is built,
    # in the thread that steps it); --torch-threads overrides it.
    threads = args.torch_threads or serving_torch_threads(model_parameters(engines[(8, False)].engine), user_threads)
    if threads is not None:
        torch.set_num_threads(threads)
    gc.collect()
    gc.freeze()  # as the served model does after start-up: collections walk request-lived objects only
    rounds = args.rounds * (args.small_model_rounds if model.startswith("tiny-") else 1)
    pairs = [(steps, config) for config in CONFIGS for steps in STEPS]

    def run(steps: int, config: str, max_tokens: int) -> dict[str, Any]:
        with_lora, names = CONFIGS[config]
        return engines[(steps, with_lora)].run(args.batch, max_tokens, names)

    for steps, config in pairs:  # unmeasured: first steps, adapter loading
        run(steps, config, 8)
    measured: dict[tuple[int, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
    load = [os.getloadavg()[0]]
    for round_index in range(rounds):
        order = pairs if round_index % 2 == 0 else pairs[::-1]
        for steps, config in order:
            result = run(steps, config, args.max_tokens)
            measured[(steps, config)].append(result)
            print(
                f"[{model}] round {round_index + 1}/{rounds} steps {steps} {config}: "
                f"{result['tokens_per_s']:.1f} tok/s, TPOT {result['tpot_ms']:.2f} ms, "
                f"CPU {result['cpu_s_per_1k_tokens']:.2f} s/1k tokens",
                flush=True,
            )
        load.append(os.getloadavg()[0])
    summary = summarize(model, measured, rounds, args)
    summary["torch_threads"] = torch.get_num_threads()
    summary["build_s"] = {f"steps{s}, LoRA {'on' if lo else 'off'}": e.build_s for (s, lo), e in engines.items()}
    summary["load_average_1min"] = load
    for engine in engines.values():
        engine.engine.model_executor.shutdown()
    return summary


def model_process(model: str, args: argparse.Namespace, adapter_dirs: dict[str, str], conn: Connection) -> None:
    conn.send(measure_model(model, args, adapter_dirs))


def summarize(
    model: str, measured: dict[tuple[int, str], list[dict[str, Any]]], rounds: int, args: argparse.Namespace
) -> dict[str, Any]:
    def per_round(steps: int, config: str, key: str) -> list[float]:
        return [r[key] for r in measured[(steps, config)]]

    configs: dict[str, Any] = {}
    for config in CONFIGS:
        entry: dict[str, Any] = {}
        for steps in STEPS:
            tps = per_round(steps, config, "tokens_per_s")
            reference = per_round(steps, REFERENCE, "tokens_per_s")
            tpot = per_round(steps, config, "tpot_ms")
            cpu = per_round(steps, config, "cpu_s_per_1k_tokens")
            cpu_reference = per_round(steps, REFERENCE, "cpu_s_per_1k_tokens")
            runs = measured[(steps, config)]
            entry[f"steps{steps}"] = {
                "tokens_per_s": median(tps),
                "tpot_ms": median(tpot),
                "ttft_ms": median(per_round(steps, config, "ttft_ms")),
                "vs_base_no_lora": median([a / b for a, b in zip(tps, reference, strict=True)]),
                "cpu_s_per_1k_tokens": median(cpu),
                "cpu_vs_base_no_lora": median([a / b for a, b in zip(cpu, cpu_reference, strict=True)]),
                "tokens_per_s_best": max(tps),
                "vs_base_no_lora_best": max(tps) / max(reference),
                "tokens_per_s_rounds": tps,
                "tpot_ms_rounds": tpot,
                "engine_steps": runs[0]["engine_steps"],
                "step_ms": median(per_round(steps, config, "step_ms")),
                "phase_ms": {k: median([r["phase_ms"][k] for r in runs]) for k in runs[0]["phase_ms"]},
                "lora_ms": {k: median([r["lora_ms"][k] for r in runs]) for k in runs[0]["lora_ms"]},
            }
        s8, s1 = per_round(8, config, "tokens_per_s"), per_round(1, config, "tokens_per_s")
        entry["steps8_vs_steps1"] = median([a / b for a, b in zip(s8, s1, strict=True)])
        configs[config] = entry

    def first_tokens(steps: int, config: str) -> list[list[int]]:
        return measured[(steps, config)][0]["token_ids"]

    base = first_tokens(8, REFERENCE)
    adapter_tokens = first_tokens(8, "4 adapters")
    checks = {
        "steps8_tokens_equal_steps1": {c: first_tokens(8, c) == first_tokens(1, c) for c in CONFIGS},
        "base_tokens_equal_with_lora_on": first_tokens(8, "base, LoRA on") == base
        and first_tokens(1, "base, LoRA on") == first_tokens(1, REFERENCE),
        "adapters_change_every_request": all(a != b for a, b in zip(adapter_tokens, base, strict=True)),
        "every_request_got_max_tokens": all(
            len(t) == args.max_tokens for runs in measured.values() for run in runs for t in run["token_ids"]
        ),
    }
    for runs in measured.values():
        for run in runs:
            del run["token_ids"]
    return {
        "model": model,
        "rounds": rounds,
        "configs": configs,
        "checks": checks,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} (batch {result['batch']}, {result['max_tokens']} tokens per request, "
        f"{result['rounds']} rounds, torch threads {result['torch_threads']}):",
        "| configuration | steps 8 tok/s | vs base, no LoRA | TPOT ms | TTFT ms | steps 1 tok/s | vs base, no LoRA "
        "| TPOT ms | TTFT ms | steps 8 / steps 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, entry in result["configs"].items():
        cells = [config]
        for steps in STEPS:
            figures = entry[f"steps{steps}"]
            cells += [f"{figures['tokens_per_s']:.1f}", f"{figures['vs_base_no_lora']:.2f}"]
            cells += [f"{figures['tpot_ms']:.1f}", f"{figures['ttft_ms']:.0f}"]
        cells.append(f"{entry['steps8_vs_steps1']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "per engine step, ms (medians): step = forward (of which LoRA ops) + set_active_loras + the rest;"
        " CPU-s per 1k tokens (vs base, no LoRA)",
        "| configuration | steps | step | forward | LoRA ops | set_active_loras | output processing "
        "| CPU-s / 1k tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, entry in result["configs"].items():
        for steps in STEPS:
            f = entry[f"steps{steps}"]
            lines.append(
                f"| {config} | {steps} | {f['step_ms']:.2f} | {f['phase_ms']['forward']:.2f} "
                f"| {f['lora_ms']['lora_ops']:.2f} | {f['lora_ms']['set_active_loras']:.2f} "
                f"| {f['phase_ms']['output_processing']:.2f} "
                f"| {f['cpu_s_per_1k_tokens']:.2f} ({f['cpu_vs_base_no_lora']:.2f}) |"
            )
    failed = [name for name, ok in result["checks"].items() if not (all(ok.values()) if isinstance(ok, dict) else ok)]
    lines.append("checks: " + ("all passed" if not failed else "FAILED " + ", ".join(failed)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=None, help=f"demo model names (default: {' '.join(DEFAULT_MODELS)})"
    )
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests per batch")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; --quick 16)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 2; --quick 1)")
    parser.add_argument(
        "--small-model-rounds",
        type=int,
        default=4,
        help="rounds multiplier for the tiny demo models (their batches take well under a second)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads (default: the served thread policy)"
    )
    parser.add_argument("--quick", action="store_true", help="one round of 16 tokens, SmolLM2 only")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    args.models = args.models or (["smollm2-135m-instruct"] if args.quick else list(DEFAULT_MODELS))
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 2)
    output = args.output or RESULTS / ("lora_throughput_quick.json" if args.quick else "lora_throughput.json")
    from triton_vllm_multistep.checks import adapters as lora
    from triton_vllm_multistep.demo import models as demo_models

    results = []
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        for model in args.models:
            model_dir = demo_models.build(model)
            adapter_dirs = {
                name: str(
                    lora.write_adapter(
                        model_dir, Path(root, model, name), seed=i + 1, rank=8, target_modules=lora.ATTENTION + lora.MLP
                    )
                )
                for i, name in enumerate(ADAPTERS)
            }
            # One process per model: its four engines share one interpreter, and all of it is
            # returned to the host before the next model.
            parent, child = context.Pipe()
            process = context.Process(target=model_process, args=(model, args, adapter_dirs, child))
            process.start()
            child.close()
            try:
                result = parent.recv()
            except EOFError:
                process.join()
                raise SystemExit(f"the {model} process died (exit code {process.exitcode})") from None
            process.join()
            result.update(batch=args.batch, max_tokens=args.max_tokens)
            results.append(result)
            print(table(result), flush=True)
    report = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_average": os.getloadavg()},
        "settings": {
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "adapters": "rank 8, alpha 16, q/k/v/o/gate/up/down projections of every layer (checks/adapters.py)",
            "engine_lora": {"max_loras": 4, "max_cpu_loras": 4, "max_lora_rank": 8},
        },
        "models": results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {output}")
    for result in results:
        print("\n" + table(result))


if __name__ == "__main__":
    main()
