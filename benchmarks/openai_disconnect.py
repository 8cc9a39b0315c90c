"""How soon a streamed OpenAI request stops in the engine after its client leaves: ours and vLLM's.

Each trial streams a long greedy completion (1,000 tokens of the demo model's 1,024 positions) from
`/v1/completions`, reads three chunks, closes the connection, then polls the server's
`vllm:num_requests_running` until it is 0; it prints the seconds that took and the tokens the engine
generated for the request (`vllm:generation_tokens_total`, read 1 s later). Configurations are the
served benchmark's (benchmarks/served/targets.toml), started one at a time on this host alone:

    .venv/bin/python -m benchmarks.openai_disconnect --configs v1_step_openai vllm_serve_v1 --trials 30

Prints one line per trial and a summary per configuration (trials whose request ran to its end).
Figures only: the checks that a leaving client stops its request are the e2e tests'.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.served import peers
from benchmarks.served.servers import start_configuration
from benchmarks.served.settings import CONFIGS, DEFAULT_MODEL_REFERENCE, KV_CACHE_GIB, MODEL
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.settings.v1_environment import v1_environment_python
from triton_vllm_multistep.testing import vllm_serve

LONG = 1000  # tokens asked for: ~4 s of the demo model on this host, far longer than the leaving takes


def total(metrics_text: str, name: str) -> float:
    """The sum of a metric's samples (one model is served: Triton's and vLLM's labels alike)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith((name + "{", name + " "))
    )


def trial(api_url: str, metrics_url: str) -> tuple[float, float]:
    """One request left after three chunks: (seconds until it stopped running, tokens generated)."""
    before = total(requests.get(metrics_url, timeout=10).text, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": [1, 5, 9], "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    with requests.post(f"{api_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as answer:
        lines = answer.iter_lines()
        for _ in range(6):  # three chunks: "data: {...}" and a blank line each
            next(lines)
    while total(requests.get(metrics_url, timeout=10).text, "vllm:num_requests_running") > 0:
        if time.monotonic() - started > 60:
            break
        time.sleep(0.05)
    stopped = time.monotonic() - started
    time.sleep(1.0)  # the counters of the last steps
    generated = total(requests.get(metrics_url, timeout=10).text, "vllm:generation_tokens_total") - before
    return stopped, generated


def start(name: str, workdir: Path, model: str) -> tuple[object, float]:
    """The configuration's server; `vllm serve` with its statistics on (the benchmark's peer turns them
    off as our backend does, and V1 then keeps no request metrics to poll)."""
    config = CONFIGS[name]
    if config.server != peers.VLLM_SERVE_V1:
        return start_configuration(name, workdir, model, None)
    values = {**peers.peer_engine_values(model), **config.engine}
    values.pop("disable_log_stats")
    environment = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    return vllm_serve.start_vllm_serve(v1_environment_python(), values, MODEL, workdir / f"{name}.log", environment)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["v1_step_openai", "vllm_serve_v1"])
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    model = DEFAULT_MODEL_REFERENCE
    demo_models.resolve(model)  # built before any server starts
    with tempfile.TemporaryDirectory(prefix="openai-disconnect-") as workdir:
        for name in args.configs:
            server, took = start(name, Path(workdir), model)
            try:
                api_url = getattr(server, "openai_url", None) or server.http_url
                metrics_url = getattr(server, "metrics_url", None) or f"{server.http_url}/metrics"
                print(f"{name}: ready in {took:.0f} s", flush=True)
                ran_to_end, stops = 0, []
                for index in range(args.trials):
                    stopped, generated = trial(api_url, metrics_url)
                    stops.append(stopped)
                    ran_to_end += generated >= LONG * 0.9
                    print(f"  {name} trial {index}: stopped after {stopped:.2f} s, {generated:.0f} tokens", flush=True)
                stops.sort()
                print(
                    f"{name}: {ran_to_end} of {args.trials} ran (nearly) to their end; stopped after median "
                    f"{stops[len(stops) // 2]:.2f} s, max {stops[-1]:.2f} s",
                    flush=True,
                )
            finally:
                server.stop()


if __name__ == "__main__":
    main()
