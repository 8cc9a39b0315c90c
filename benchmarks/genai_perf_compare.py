"""The field's benchmark tool beside the project's own load generator (issue #25; figures, not a test).

NVIDIA genai-perf 0.0.8 (with the perf_analyzer of tritonclient 2.51; `scripts/setup_bench_tools.sh`
installs both into .venv-bench) measures, on the same servers and at the same concurrency levels:

- `kserve`: this backend over KServe gRPC (`--service-kind triton --backend vllm --streaming`: text_input,
  stream, sampling_parameters {max_tokens, min_tokens}, exclude_input_in_output);
- `openai`: the same server's OpenAI-compatible API (`serve --openai-port`), streaming /v1/completions;
- `vllm_serve`: `vllm serve` on the same engine arguments and model (steps 1: vLLM has no multi-step
  on CPU), streaming /v1/completions;

then the project's own load generator (benchmarks/served/load.py, the client of the served
benchmark) on the same three with the same prompt lengths, so the two tools' figures can be put side
by side. The servers: benchmarks/served (steps8_step_openai: the shipped per-step configuration with
the engine in a process of its own, the KServe and OpenAI paths on ONE server; vllm_serve). Every
request: synthetic prompts of `--input-tokens` tokens, `--output-tokens` output tokens (genai-perf:
max_tokens = min_tokens, our generator: max_tokens with ignore_eos). Writes
benchmarks/results/genai_perf_compare.json and prints a table.

    scripts/setup_bench_tools.sh
    .venv/bin/python -m benchmarks.genai_perf_compare                     # demo model, 1 8 32 64 streams
    .venv/bin/python -m benchmarks.genai_perf_compare --concurrency 1 32 --requests-per-stream 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.served import load, servers
from benchmarks.served.settings import DEFAULT_MODEL_REFERENCE, MODEL, RESULTS_DIR

ROOT = Path(__file__).resolve().parents[1]
BENCH_VENV = ROOT / ".venv-bench"


def bench_environment() -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH as scripts/bench_tool_env.sh sets them."""
    cudart = next(BENCH_VENV.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"), None)
    if not (BENCH_VENV / "bin" / "genai-perf").exists() or cudart is None:
        raise SystemExit("genai-perf is not installed: run scripts/setup_bench_tools.sh")
    env = dict(os.environ)
    env["PATH"] = f"{BENCH_VENV / 'bin'}:{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = f"{cudart}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return env


def genai_perf(
    kind: str, url: str, concurrency: int, args: argparse.Namespace, tokenizer: str, workdir: Path
) -> dict[str, Any]:
    """One genai-perf profile; returns its figures (tokens/s, TTFT and ITL p50 in ms, requests)."""
    artifacts = workdir / f"{kind}-c{concurrency}"
    command = ["genai-perf", "profile", "-m", MODEL, "-u", url, "--streaming", "--concurrency", str(concurrency)]
    if kind == "kserve":
        command += ["--service-kind", "triton", "--backend", "vllm", "--output-tokens-mean-deterministic"]
    else:
        command += ["--service-kind", "openai", "--endpoint-type", "completions"]
    command += [
        "--num-prompts",
        "100",
        "--synthetic-input-tokens-mean",
        str(args.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.output_tokens),
        "--output-tokens-stddev",
        "0",
        "--tokenizer",
        tokenizer,
        "--artifact-dir",
        str(artifacts),
    ]
    if kind != "kserve":
        # OpenAI has no min_tokens: ignore_eos keeps every answer at max_tokens, as the KServe path's min_tokens.
        command += ["--extra-inputs", "ignore_eos:true"]
    command += ["--", "--request-count", str(max(args.requests_per_stream * concurrency, 8))]
    done = subprocess.run(command, env=bench_environment(), capture_output=True, text=True, cwd=workdir)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    found = next(artifacts.rglob("profile_export_genai_perf.json"), None)
    if found is None:
        return {"error": f"no profile_export_genai_perf.json under {artifacts}"}
    data = json.loads(found.read_text())
    return {
        "tokens_per_s": data["output_token_throughput"]["avg"],
        "ttft_ms_p50": data["time_to_first_token"]["p50"] / 1e6 if _ns(data) else data["time_to_first_token"]["p50"],
        "itl_ms_p50": data["inter_token_latency"]["p50"] / 1e6 if _ns(data) else data["inter_token_latency"]["p50"],
        "output_tokens_avg": data["output_sequence_length"]["avg"],
        "requests": data.get("request_throughput", {}).get("avg"),
    }


def _ns(data: dict[str, Any]) -> bool:
    return data["time_to_first_token"].get("unit", "ms") == "ns"


async def own_generator(server: Any, kind: str, concurrency: int, args: argparse.Namespace, prompt: str) -> dict:
    """The served benchmark's client and figures (load.summarize: best wave's tokens/s, TTFT and ITL
    as it defines them): waves of `concurrency` streams after an unmeasured one."""
    streams = load.streams_for(server, kind, args.output_tokens)
    tally = load.LevelTally([], [], [], 0.0)
    waves = max(2, args.requests_per_stream)
    try:
        await load.run_wave(streams, concurrency, 0)  # unmeasured
        for _ in range(waves):
            started = time.perf_counter()
            batch = await asyncio.gather(*(streams.request(f"{i} {prompt}") for i in range(concurrency)))
            elapsed = time.perf_counter() - started
            tally.records.extend(batch)
            tally.seconds += elapsed
            tally.wave_rates.append(sum(r.tokens for r in batch) / elapsed)
            tally.wave_responses.append(sum(len(r.counts) for r in batch) / elapsed)
    finally:
        await streams.close()
    level = load.summarize(tally, concurrency, waves, args.output_tokens)
    return {
        "tokens_per_s": level["tokens_per_s"],
        "tokens_per_s_mean": level["tokens_per_s_mean"],
        "ttft_ms_p50": level["ttft_ms"]["p50"],
        "itl_ms_p50": level["itl_ms"]["p50"],
        "errors": level["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_REFERENCE)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "genai_perf_compare.json")
    args = parser.parse_args()
    from triton_vllm_multistep.demo import models as demo_models

    tokenizer = demo_models.resolve(args.model) if args.model.startswith("demo://") else args.model
    bench_environment()  # fail before starting servers
    workdir = Path(tempfile.mkdtemp(prefix="genai-perf-"))
    started: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    try:
        for name in ("steps8_step_openai", "vllm_serve"):
            started[name], ready = servers.start_configuration(name, workdir, args.model, None)
            print(f"{name}: ready after {ready:.1f} s", flush=True)
        ours, peer = started["steps8_step_openai"], started["vllm_serve"]
        endpoints = {
            "kserve": (ours, "backend", f"127.0.0.1:{ours.grpc_port}"),
            "openai": (ours, load.BACKEND_OPENAI, ours.openai_url.removeprefix("http://")),
            "vllm_serve": (peer, "vllm_serve", peer.http_url.removeprefix("http://")),
        }
        # A prompt of about --input-tokens tokens for our generator (genai-perf makes its own).
        prompt = " ".join(["word"] * max(1, args.input_tokens - 4))
        for concurrency in args.concurrency:
            for kind, (server, client_kind, url) in endpoints.items():
                theirs = genai_perf(kind, url, concurrency, args, tokenizer, workdir)
                mine = asyncio.run(own_generator(server, client_kind, concurrency, args, prompt))
                results.append({"concurrency": concurrency, "endpoint": kind, "genai_perf": theirs, "own": mine})
                print(f"c={concurrency:3d} {kind:10s} genai-perf {_fmt(theirs)} | own {_fmt(mine)}", flush=True)
    finally:
        for server in started.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    args.output.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
    )
    print(f"written to {args.output}")


def _fmt(figures: dict[str, Any]) -> str:
    if "error" in figures:
        return "error: " + figures["error"].strip().splitlines()[-1][:120]
    return (
        f"{figures['tokens_per_s']:8.1f} tok/s  ttft p50 {figures['ttft_ms_p50'] or 0:7.1f} ms"
        f"  itl p50 {figures['itl_ms_p50'] or 0:6.2f} ms"
    )


if __name__ == "__main__":
    main()
