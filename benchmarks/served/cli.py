"""Served streaming benchmark: the backend through a real tritonserver vs the same engine offline.

One command (`.venv/bin/python -m benchmarks.served_bench`, `--quick` for a short run, `--smoke`
for the quickest run that goes through every part) measures, on the model of `--model` (default
the demo model) with the shipped model.json settings and a 1 GiB KV cache:

1. the ceilings: the same engine offline (`LLM.generate` on the whole batch, steps 1 and 8, each
   in a child process of its own, with torch on all cores and on all cores but one) and the
   forward-only ceiling of `step_timing`;
2. served, `num_scheduler_steps` 1;
3. served, steps 8, one response per decoded step (`stream_mode` step);
4. served, steps 8, one response per scheduling window (`stream_mode` window);
5. when named with --configs, what users would run instead on the same engine and model (peers,
   benchmarks/served/peers.py): Triton's vLLM backend (`triton_vllm_backend`, needs
   --triton-vllm-backend) and `vllm serve` (`vllm_serve`, streaming /v1/completions);

at each concurrency (1, 8, 32, 64 streams by default). One server per configuration, started
one after the other and all kept running (`--passes 2`: all of it again on new servers started in
the reverse order, since the server started first runs slower on this host; for a ratio, name its
two configurations first and last). At each level the waves alternate between them (the
order rotating) and after each round the offline engines run the same batch, so that the
figures a ratio compares are taken seconds apart and a shared host's drift hits them alike (the
processes not being measured sit idle). The load generator is `tritonclient.grpc.aio`:
`concurrency` streams start together (one wave; a few waves per level and configuration), each
with a distinct prompt, greedy, a fixed number of output tokens (`ignore_eos`). Throughput is that
of the best wave, offline that of the best run; latencies are over all waves. CPU seconds per
1,000 output tokens are measured with psutil for tritonserver, the Python backend stub (where the
engine runs) and this client. Writes benchmarks/results/served.json, .md and .png; asserts
nothing, but prints whether each target of the performance issue (benchmarks/served/targets.toml)
is met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.served import report, servers
from benchmarks.served.offline import OfflineEngines
from benchmarks.served.settings import (
    CONFIGS,
    DEFAULT_MODEL_REFERENCE,
    KV_CACHE_GIB,
    RESULTS_DIR,
    SHARED_PREFIX,
    shared_system_prompt,
)


def model_reference(value: str) -> str:
    """A model.json `model` reference: demo://NAME, a Hugging Face id, or a folder (made absolute)."""
    from triton_vllm_multistep.demo import models as demo_models

    if value.startswith(demo_models.DEMO_SCHEME):
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        type=model_reference,
        default=DEFAULT_MODEL_REFERENCE,
        help="what model.json's 'model' becomes: demo://NAME, a model folder or a Hugging Face id "
        f"(default {DEFAULT_MODEL_REFERENCE}); the other model.json settings stay the shipped ones",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="WORDS",
        help="the shared-prefix run instead: every prompt starts with the same system prompt of about WORDS "
        "words; served with prefix caching off and on (time to first token); no offline engines; "
        "output served_prefix.json",
    )
    parser.add_argument("--wave-scale", type=float, default=1.0, help="scales the number of waves per level")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 32 only, fewer waves")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the quickest run through every part (1 stream, 8 tokens, 2 waves; output served-smoke.json): "
        "proves the benchmark works, measures nothing worth keeping",
    )
    parser.add_argument(
        "--triton-vllm-backend",
        type=Path,
        default=None,
        metavar="DIR",
        help="the src/ folder of a triton-inference-server/vllm_backend checkout (r25.05): needed by the "
        "triton_vllm_backend configuration (Triton's vLLM backend on the same engine, a peer)",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="measure every level N times on new servers, started as named, then in reverse order, in turn "
        "(a server's start position moves its forward pass by up to ~10%% on a 2-core VM; "
        "docs/performance.md): 2 for a ratio between configurations (the #32 targets)",
    )
    parser.add_argument("--skip-offline", action="store_true", help="reuse the offline figures of --output")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/served.json")
    args = parser.parse_args()

    if args.quick:
        args.concurrency = [1, 32]
        args.wave_scale = 0.5
    if args.smoke:
        args.concurrency = [1]
        args.max_tokens = 8
        args.wave_scale = 0.0  # the minimum: 2 waves
    if args.configs is None:
        args.configs = [
            name
            for name, config in CONFIGS.items()
            if config.in_default_run and config.prefix_run == bool(args.shared_prefix)
        ]
    if args.output is None:
        name = "served_prefix" if args.shared_prefix else "served"
        args.output = RESULTS_DIR / (f"{name}-smoke.json" if args.smoke else f"{name}.json")
    if args.shared_prefix:
        run_shared_prefix(args)
        return
    from triton_vllm_multistep.demo import models as demo_models

    demo_models.resolve(args.model)  # builds a demo model before anything times its load
    started = time.monotonic()
    engines = None
    if args.skip_offline and args.output.exists():
        offline = json.loads(args.output.read_text())["offline"]
    else:
        engines = OfflineEngines(args.max_tokens, args.model)  # built before the servers start, idle meanwhile
    try:
        with tempfile.TemporaryDirectory(prefix="served-bench-") as tmp:
            served = servers.run_served(
                args.configs,
                args.concurrency,
                args.max_tokens,
                args.wave_scale,
                Path(tmp),
                args.model,
                engines,
                args.triton_vllm_backend,
                args.passes,
            )
        if engines is not None:
            offline = engines.results()
    finally:
        if engines is not None:
            engines.close()
    results = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "kv_cache_gib": int(KV_CACHE_GIB),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "command": " ".join(["python -m benchmarks.served_bench", *sys.argv[1:]]),
        "wall_seconds": None,
        "offline": offline,
        "served": served,
    }
    report.annotate(results)
    results["wall_seconds"] = time.monotonic() - started
    write_results(args.output, results, report.format_table(results), chart=True)


def run_shared_prefix(args: argparse.Namespace) -> None:
    """Prefix caching's gain where chat traffic has it: every request shares the system prompt."""
    from transformers import AutoTokenizer

    from triton_vllm_multistep.demo import models as demo_models

    SHARED_PREFIX["text"] = shared_system_prompt(args.shared_prefix)
    tokenizer = AutoTokenizer.from_pretrained(str(demo_models.resolve(args.model)))
    prefix_tokens = len(tokenizer(SHARED_PREFIX["text"]).input_ids)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="served-bench-") as tmp:
        served = servers.run_served(
            args.configs, args.concurrency, args.max_tokens, args.wave_scale, Path(tmp), args.model, None
        )
    results = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "shared_prefix_words": args.shared_prefix,
        "shared_prefix_tokens": prefix_tokens,
        "cpu_count": os.cpu_count(),
        "command": " ".join(["python -m benchmarks.served_bench", *sys.argv[1:]]),
        "served": served,
        "wall_seconds": time.monotonic() - started,
    }
    write_results(args.output, results, report.format_prefix_table(results), chart=False)


def write_results(output: Path, results: dict, table: str, chart: bool) -> None:
    """The figures as JSON, the table as Markdown beside them (and the chart), and the table printed."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    if chart:
        report.plot(results, output.with_suffix(".png"))
    output.with_suffix(".md").write_text(table + "\n")
    print(table)
    written = "(and .md, .png)" if chart else "(and .md)"
    print(f"written to {output} {written} in {results['wall_seconds']:.0f} s")
