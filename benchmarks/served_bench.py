"""Served streaming benchmark: the backend through a real tritonserver vs the same engine offline.

One command (`.venv/bin/python -m benchmarks.served_bench`, `--quick` for a short run) measures,
on the demo model with the shipped model.json settings and a 1 GiB KV cache:

1. the ceilings: the same engine offline (`LLM.generate` on the whole batch, steps 1 and 8, each
   in a child process of its own, with torch on all cores and on all cores but one) and the
   forward-only ceiling of `step_timing`;
2. served, `num_scheduler_steps` 1;
3. served, steps 8, one response per decoded step (`stream_mode` step);
4. served, steps 8, one response per scheduling window (`stream_mode` window);

at each concurrency (1, 8, 32, 64 streams by default). One server per configuration, started
one after the other and all kept running. At each level the waves alternate between them (the
order rotating) and after each round the offline engines run the same batch, so that the
figures a ratio compares are taken seconds apart and a shared host's drift hits them alike (the
processes not being measured sit idle). The load generator is `tritonclient.grpc.aio`:
`concurrency` streams start together (one wave; a few waves per level and configuration), each
with a distinct prompt, greedy, a fixed number of output tokens (`ignore_eos`). Throughput is that
of the best wave, offline that of the best run; latencies are over all waves. CPU seconds per
1,000 output tokens are measured with psutil for tritonserver, the Python backend stub (where the
engine runs) and this client. Writes benchmarks/results/served.json, .md and .png; asserts
nothing, but prints whether each target of the performance issue is met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.testing import local_server
from triton_vllm_multistep.testing.local_server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
SOURCE_MODEL = ROOT / "model_repository" / "vllm_model"
MODEL = "vllm_model"
KV_CACHE_GIB = "1"
PROMPTS = (
    "the model streams every token of a response while the engine schedules",
    "cats sleep near warm windows and rivers run to the sea",
    "people write code read books and drink coffee in small cafes",
    "a quick brown fox jumps over lazy dogs under bright stars",
)
# name → (label, num_scheduler_steps, stream_mode)
CONFIGS: dict[str, tuple[str, int, str]] = {
    "steps1": ("served, steps 1", 1, "step"),
    "steps8_step": ("served, steps 8, per step", 8, "step"),
    "steps8_window": ("served, steps 8, per window", 8, "window"),
}
# The targets (checked here, never by timed tests).
TARGET_CONCURRENCY = 32
TARGETS = {
    "steps8_step_vs_ceiling": 0.75,
    "steps8_window_vs_ceiling": 0.90,
    "steps8_step_vs_steps1": 1.15,
    "steps8_window_vs_steps1": 1.25,
    "ttft_ms_at_1": 20.0,
    "itl_step_vs_steps1_at_1": 1.10,
    "ready_seconds": 10.0,
    "idle_memory_gb": 2.4,
}


def prompt(i: int) -> str:
    """Distinct prompts of similar length."""
    return f"request {i}: {PROMPTS[i % len(PROMPTS)]}"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return ordered[index]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def waves_for(concurrency: int, scale: float) -> int:
    """More waves at low concurrency, where a wave is short and latency samples are few."""
    return max(2, round(scale * max(3, 24 / concurrency)))


# --------------------------------------------------------------------------- offline (child)


def engine_json(steps: int) -> dict[str, Any]:
    data = json.loads((SOURCE_MODEL / "1" / "model.json").read_text())
    data["num_scheduler_steps"] = steps
    return data


ANSWER_MARK = "@@offline-engine@@ "


def offline_engine_process(steps: int, max_tokens: int) -> None:
    """Runs in a child process: one engine (the served model's settings at `steps`), measured on request.

    Reads JSON commands on stdin, one per line, and answers each with one JSON line on stdout:
    {"op": "generate", "threads": t, "batch": b} runs `LLM.generate` on `b` distinct prompts (the
    same prompts and settings as a served wave) with torch on `t` threads; {"op": "forward_only",
    "threads": t, "batch": b} measures step_timing's forward-only ceiling. Both answer {"tok_s": x}.
    """
    os.environ["VLLM_USE_V1"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    import torch
    from vllm import LLM, SamplingParams
    from vllm.utils import Counter

    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.stub import config as backend_config
    from triton_vllm_multistep.testing.step_timing import forward_only_ceiling

    # All cores and all cores but one (what the served engine uses), unless the user chose a count.
    # Read before the build: vLLM's CPU platform sets OMP_NUM_THREADS while building.
    cores = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else len(os.sched_getaffinity(0))
    thread_counts = sorted({cores, max(1, cores - 1)}, reverse=True)
    settings = backend_config.BackendSettings(stream_per_step=False)
    engine = build_engine(backend_config.engine_args(engine_json(steps), SOURCE_MODEL, settings), stream_per_step=False)
    # LLM.generate itself, on this engine (LLM() would build vLLM's CPU engine, which has no multi-step).
    llm = LLM.__new__(LLM)
    llm.llm_engine = engine
    llm.engine_class = type(engine)
    llm.request_counter = Counter()
    llm.default_sampling_params = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    context_len = len(engine.get_tokenizer().encode(prompt(0))) + max_tokens // 2
    for threads in thread_counts:
        torch.set_num_threads(threads)
        llm.generate([prompt(i) for i in range(8)], params, use_tqdm=False)  # warm-up
    print(ANSWER_MARK + json.dumps({"thread_counts": thread_counts}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        torch.set_num_threads(command["threads"])
        batch = command["batch"]
        if command["op"] == "forward_only":
            value = forward_only_ceiling(engine, batch, context_len=context_len)
        else:
            prompts = [prompt(command.get("offset", 0) + i) for i in range(batch)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            value = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        print(ANSWER_MARK + json.dumps({"tok_s": value}), flush=True)
    engine.model_executor.shutdown()


def _keep_best(figures: dict[str, float], concurrency: int, value: float) -> None:
    figures[str(concurrency)] = max(figures.get(str(concurrency), 0.0), value)


class OfflineEngines:
    """The same engine offline (steps 1 and 8, one child process each), measured between served waves.

    Each figure is measured at the thread counts the child reports (all cores and all cores but
    one, see engine_factory.serving_torch_threads); per concurrency the best run is kept
    (as a served level keeps its best wave), and the ceiling is the best thread count.
    """

    STEPS = (1, 8)

    def __init__(self, max_tokens: int) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, VLLM_USE_V1="0")
        self._children: dict[int, subprocess.Popen] = {}
        self.thread_counts: list[int] = []
        for steps in self.STEPS:
            command = [sys.executable, "-m", "benchmarks.served_bench", "--offline-engine", str(steps)]
            command += ["--max-tokens", str(max_tokens)]
            child = subprocess.Popen(
                command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            self._children[steps] = child
            self.thread_counts = self._answer(child)["thread_counts"]  # one at a time: builds do not overlap
        # steps → threads → concurrency → best tok/s, and threads → concurrency → forward-only
        self.generate: dict[str, dict[str, dict[str, float]]] = {
            str(s): {str(t): {} for t in self.thread_counts} for s in self.STEPS
        }
        self.forward_only: dict[str, dict[str, float]] = {str(t): {} for t in self.thread_counts}

    @staticmethod
    def _answer(child: subprocess.Popen) -> dict[str, Any]:
        while True:  # vLLM logs to stdout too: answers are the marked lines
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"offline engine process exited with {child.wait()}")
            if line.startswith(ANSWER_MARK):
                return json.loads(line[len(ANSWER_MARK) :])

    def _ask(self, steps: int, **command: Any) -> float:
        child = self._children[steps]
        child.stdin.write(json.dumps(command) + "\n")
        child.stdin.flush()
        return self._answer(child)["tok_s"]

    def measure_generate(self, concurrency: int, offset: int) -> None:
        """One LLM.generate per steps value and thread count, keeping the best per concurrency."""
        for steps in self.STEPS:
            for threads in self.thread_counts:
                value = self._ask(steps, op="generate", threads=threads, batch=concurrency, offset=offset)
                _keep_best(self.generate[str(steps)][str(threads)], concurrency, value)

    def measure_forward_only(self, concurrency: int) -> None:
        for threads in self.thread_counts:
            value = self._ask(8, op="forward_only", threads=threads, batch=concurrency)
            _keep_best(self.forward_only[str(threads)], concurrency, value)

    def results(self) -> dict[str, Any]:
        """In the shape `annotate` and the report read (also what --skip-offline reuses)."""
        concurrencies = list(next(iter(self.forward_only.values())))
        generate = {
            s: {c: max(by_threads[t][c] for t in by_threads) for c in concurrencies}
            for s, by_threads in self.generate.items()
        }
        for steps, by_threads in self.generate.items():
            for threads, figures in by_threads.items():
                for c in concurrencies:
                    print(f"offline LLM.generate steps={steps} threads={threads} batch={c}: {figures[c]:8.1f} tok/s")
        return {
            "llm_generate": generate,
            "llm_generate_by_threads": self.generate,
            "forward_only": {c: max(f[c] for f in self.forward_only.values()) for c in concurrencies},
            "forward_only_by_threads": self.forward_only,
            "torch_threads": self.thread_counts,
        }

    def close(self) -> None:
        for child in self._children.values():
            if child.poll() is None:
                child.stdin.close()
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()


# --------------------------------------------------------------------------- server


def make_repository(target: Path, steps: int, stream_mode: str) -> Path:
    # The shipped model is the real one; this overhead-bound benchmark runs the tiny demo model.
    engine = {"model": "demo://tiny-llama-bpe", "max_model_len": 1024, "num_scheduler_steps": steps}
    local_server.copy_model(SOURCE_MODEL, target / MODEL, engine, {"stream_mode": stream_mode})
    return target


def start_server(repository: Path, log_path: Path, attempts: int = 3) -> tuple[ServerProcess, float]:
    """Start the launcher on free ports; returns the server and its seconds from start to READY.

    Other servers may start on this host meanwhile: a port taken between choosing and binding it
    only costs a retry on new ports.
    """
    for attempt in range(attempts):
        started = time.monotonic()
        server = local_server.start_server(repository, log_path, env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB})
        try:
            return server, server.wait_ready(poll=0.05, started=started)
        except RuntimeError:
            server.stop()
            if "already in use" not in log_path.read_text(errors="replace") or attempt == attempts - 1:
                raise
            print("  a port was taken meanwhile; starting again on other ports", flush=True)
    raise AssertionError("unreachable")


def memory_of(server: ServerProcess) -> dict[str, float]:
    """Resident (RSS) and proportional (PSS) memory of tritonserver + stubs, in GB."""
    rss = pss = 0
    for proc in [p for group in server.process_groups().values() for p in group]:
        try:
            info = proc.memory_full_info()
        except Exception:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return {"rss_gb": rss / 1e9, "pss_gb": pss / 1e9}


def cpu_seconds(procs: list[Any]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except Exception:
            continue
        total += times.user + times.system
    return total


# --------------------------------------------------------------------------- load generator


@dataclass
class RequestRecord:
    sent: float
    arrivals: list[float]
    counts: list[int]
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts)


def _make_inputs(grpcaio: Any, text: str, sampling: bytes) -> list[Any]:
    import numpy as np

    text_input = grpcaio.InferInput("text_input", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    stream = grpcaio.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([sampling], dtype=np.object_))
    return [text_input, stream, params]


async def one_request(client: Any, grpcaio: Any, text: str, sampling: bytes) -> RequestRecord:
    inputs = _make_inputs(grpcaio, text, sampling)
    record = RequestRecord(sent=time.perf_counter(), arrivals=[], counts=[])

    async def requests():
        yield {"model_name": MODEL, "inputs": inputs, "enable_empty_final_response": True}

    try:
        async for result, error in client.stream_infer(requests()):
            now = time.perf_counter()
            if error is not None:
                record.error = str(error)
                break
            response = result.get_response()
            # Token count from the raw INT32 bytes of output_ids: no numpy conversion per response.
            count = 0
            for index, output in enumerate(response.outputs):
                if output.name == "output_ids":
                    count = len(response.raw_output_contents[index]) // 4
                    break
            if count:
                record.arrivals.append(now)
                record.counts.append(count)
            if response.parameters["triton_final_response"].bool_param:
                break
    except Exception as error:  # transport errors count as errors, not crashes
        record.error = f"{type(error).__name__}: {error}"
    return record


async def run_wave(client: Any, grpcaio: Any, concurrency: int, base: int, sampling: bytes) -> list[RequestRecord]:
    """`concurrency` streams started together, each with its own prompt; returns when all ended."""
    return await asyncio.gather(*(one_request(client, grpcaio, prompt(base + i), sampling) for i in range(concurrency)))


@dataclass
class LevelTally:
    """One configuration's waves at one concurrency."""

    records: list[RequestRecord]
    wave_rates: list[float]
    wave_responses: list[float]
    seconds: float = 0.0
    cpu: dict[str, float] | None = None


def _cpu_now(groups: dict[str, list[Any]], me: Any) -> dict[str, float]:
    return {
        "tritonserver": cpu_seconds(groups["tritonserver"]),
        "stub": cpu_seconds(groups["stub"]),
        "client": cpu_seconds([me]),
    }


async def run_level(
    servers: dict[str, ServerProcess],
    concurrency: int,
    waves: int,
    max_tokens: int,
    offset: int,
    offline: OfflineEngines | None = None,
) -> dict[str, dict[str, Any]]:
    """Waves at one concurrency on every server, interleaved: wave k runs on each configuration in
    turn (the order rotating), then offline on the same prompts, so that the figures a ratio
    compares are taken seconds apart and a shared host's drift hits them alike. Each server's CPU
    time is counted over its own waves."""
    import psutil
    import tritonclient.grpc.aio as grpcaio

    sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    names = list(servers)
    clients = {name: grpcaio.InferenceServerClient(f"127.0.0.1:{servers[name].grpc_port}") for name in names}
    groups = {name: servers[name].process_groups() for name in names}
    me = psutil.Process()
    tallies = {
        name: LevelTally([], [], [], 0.0, dict.fromkeys(("tritonserver", "stub", "client"), 0.0)) for name in names
    }
    try:
        for name in names:  # one unmeasured wave each: connections, first-call paths, batch shapes
            await run_wave(clients[name], grpcaio, concurrency, offset, sampling)
        for wave in range(waves):
            base = offset + (wave + 1) * concurrency
            for name in names[wave % len(names) :] + names[: wave % len(names)]:
                tally = tallies[name]
                before = _cpu_now(groups[name], me)
                start = time.perf_counter()
                batch = await run_wave(clients[name], grpcaio, concurrency, base, sampling)
                elapsed = time.perf_counter() - start
                after = _cpu_now(groups[name], me)
                for key in tally.cpu:
                    tally.cpu[key] += after[key] - before[key]
                tally.seconds += elapsed
                tally.records.extend(batch)
                tally.wave_rates.append(sum(r.tokens for r in batch) / elapsed)
                tally.wave_responses.append(sum(len(r.counts) for r in batch) / elapsed)
            if offline is not None:
                offline.measure_generate(concurrency, base)
                offline.measure_forward_only(concurrency)
    finally:
        for client in clients.values():
            await client.close()
    return {name: summarize(tallies[name], concurrency, waves, max_tokens) for name in names}


def summarize(tally: LevelTally, concurrency: int, waves: int, max_tokens: int) -> dict[str, Any]:
    records = tally.records
    tokens = sum(r.tokens for r in records)
    errors = sum(1 for r in records if r.error or r.tokens != max_tokens)
    ttft = [1000 * (r.arrivals[0] - r.sent) for r in records if r.arrivals]
    # Inter-token latency as genai-perf defines it: per request, the time from its first response
    # to its last divided by the tokens that came after the first response.
    itl = [
        1000 * (r.arrivals[-1] - r.arrivals[0]) / (r.tokens - r.counts[0])
        for r in records
        if len(r.arrivals) > 1 and r.tokens > r.counts[0]
    ]
    gaps: list[float] = []  # per response: the gap since the previous response of the request
    for r in records:
        gaps.extend(1000 * (now - previous) for previous, now in zip(r.arrivals, r.arrivals[1:], strict=False))
    best = max(range(len(tally.wave_rates)), key=tally.wave_rates.__getitem__)
    per_1k = {name: 1000 * seconds / max(tokens, 1) for name, seconds in (tally.cpu or {}).items()}
    return {
        "concurrency": concurrency,
        "waves": waves,
        "requests": len(records),
        "output_tokens": tokens,
        "tokens_per_s": tally.wave_rates[best],
        "tokens_per_s_mean": tokens / tally.seconds,
        "tokens_per_s_waves": tally.wave_rates,
        "responses_per_s": tally.wave_responses[best],
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "inter_response_ms": percentiles(gaps),
        "errors": errors,
        "cpu_s_per_1k_tokens": per_1k,
    }


def run_served(
    names: list[str],
    concurrencies: list[int],
    max_tokens: int,
    wave_scale: float,
    workdir: Path,
    offline: OfflineEngines | None = None,
) -> list[dict[str, Any]]:
    """One server per configuration, started one after the other (start-up and idle memory are
    measured while the others idle), then every concurrency level on all of them, interleaved."""
    servers: dict[str, ServerProcess] = {}
    served: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            label, steps, mode = CONFIGS[name]
            repository = make_repository(workdir / name, steps, mode)
            server, ready = start_server(repository, workdir / f"{name}.log")
            servers[name] = server
            print(f"{label}: READY after {ready:.1f} s", flush=True)
            time.sleep(3.0)  # let start-up allocations settle before reading idle memory
            served[name] = {
                "name": name,
                "label": label,
                "num_scheduler_steps": steps,
                "stream_mode": mode,
                "ready_seconds": ready,
                "idle_memory": memory_of(server),
                "levels": [],
            }
        for index, concurrency in enumerate(concurrencies):
            levels = asyncio.run(
                run_level(
                    servers,
                    concurrency,
                    waves_for(concurrency, wave_scale),
                    max_tokens,
                    10_000 * (index + 1),
                    offline,
                )
            )
            for name, level in levels.items():
                served[name]["levels"].append(level)
                print(
                    f"  {served[name]['label']}, c={concurrency:3d}: {level['tokens_per_s']:8.1f} tok/s"
                    f"  ttft p50 {level['ttft_ms']['p50']:.1f} ms  itl p50 {level['itl_ms']['p50']:.2f} ms"
                    f"  errors {level['errors']}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    return [served[name] for name in names]


# --------------------------------------------------------------------------- report


def annotate(results: dict[str, Any]) -> None:
    """Ratios to the ceiling and to steps 1, and the targets' verdicts."""
    offline = results["offline"]["llm_generate"]
    ceilings = {c: max(offline[s][c] for s in offline) for c in offline["1"]}
    results["ceiling_tokens_per_s"] = ceilings
    # The served engine runs torch on all cores but one: the offline figure at that thread count too.
    by_threads = results["offline"].get("llm_generate_by_threads") or {}
    served_threads = str(min(results["offline"].get("torch_threads") or [0]))
    same_threads = {
        c: max(by_threads[s][served_threads][c] for s in by_threads)
        for c in ceilings
        if by_threads and all(served_threads in by_threads[s] for s in by_threads)
    }
    results["ceiling_same_threads_tokens_per_s"] = same_threads
    served = {c["name"]: {lvl["concurrency"]: lvl for lvl in c["levels"]} for c in results["served"]}
    for config in results["served"]:
        for level in config["levels"]:
            c = level["concurrency"]
            level["vs_ceiling"] = level["tokens_per_s"] / ceilings[str(c)]
            same = same_threads.get(str(c))
            level["vs_ceiling_same_threads"] = level["tokens_per_s"] / same if same else None
            base = served.get("steps1", {}).get(c)
            level["vs_steps1"] = level["tokens_per_s"] / base["tokens_per_s"] if base else None

    def ratio(name: str, key: str, concurrency: int = TARGET_CONCURRENCY) -> float | None:
        level = served.get(name, {}).get(concurrency)
        return level[key] if level else None

    checks: list[dict[str, Any]] = []

    def check(label: str, value: float | None, limit: float, at_least: bool) -> None:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        checks.append({"target": label, "value": value, "limit": limit, "at_least": at_least, "met": met})

    c = TARGET_CONCURRENCY
    check(
        f"c={c}: steps 8 per step / offline ceiling",
        ratio("steps8_step", "vs_ceiling"),
        TARGETS["steps8_step_vs_ceiling"],
        True,
    )
    check(
        f"c={c}: steps 8 per window / offline ceiling",
        ratio("steps8_window", "vs_ceiling"),
        TARGETS["steps8_window_vs_ceiling"],
        True,
    )
    for name, label in (("steps8_step", "per step"), ("steps8_window", "per window")):
        check(
            f"(info) c={c}: steps 8 {label} / offline at the served thread count",
            ratio(name, "vs_ceiling_same_threads"),
            TARGETS[f"{name}_vs_ceiling"],
            True,
        )
    check(
        f"c={c}: steps 8 per step / steps 1", ratio("steps8_step", "vs_steps1"), TARGETS["steps8_step_vs_steps1"], True
    )
    check(
        f"c={c}: steps 8 per window / steps 1",
        ratio("steps8_window", "vs_steps1"),
        TARGETS["steps8_window_vs_steps1"],
        True,
    )
    for name in CONFIGS:
        level = served.get(name, {}).get(1)
        check(
            f"c=1: TTFT p50 (ms), {CONFIGS[name][0]}",
            level["ttft_ms"]["p50"] if level else None,
            TARGETS["ttft_ms_at_1"],
            False,
        )
    step, one = served.get("steps8_step", {}).get(1), served.get("steps1", {}).get(1)
    itl_ratio = step["itl_ms"]["p50"] / one["itl_ms"]["p50"] if step and one else None
    check("c=1: ITL p50 steps 8 per step / steps 1", itl_ratio, TARGETS["itl_step_vs_steps1_at_1"], False)
    for config in results["served"]:
        check(f"start to READY (s), {config['label']}", config["ready_seconds"], TARGETS["ready_seconds"], False)
        check(
            f"idle RSS of server processes (GB), {config['label']}",
            config["idle_memory"]["rss_gb"],
            TARGETS["idle_memory_gb"],
            False,
        )
    results["targets"] = checks


def format_table(results: dict[str, Any]) -> str:
    lines = []
    offline = results["offline"]
    header = (
        "| configuration | streams | tok/s | vs ceiling (same threads) | vs steps 1 | resp/s | TTFT p50/p90/p99 ms "
        "| ITL p50/p90/p99 ms | errors | CPU s/1k tok server/stub/client |"
    )
    lines.append(header)
    lines.append("|" + "---|" * 10)
    concurrencies = list(offline["llm_generate"]["1"])
    for steps in sorted(offline["llm_generate"]):
        for c in concurrencies:
            value = offline["llm_generate"][steps][c]
            lines.append(
                f"| offline LLM.generate, steps {steps} | {c} | {value:.0f} | "
                f"{value / results['ceiling_tokens_per_s'][c]:.2f} | | | | | | |"
            )
    for c in concurrencies:
        lines.append(f"| forward-only ceiling | {c} | {offline['forward_only'][c]:.0f} | | | | | | | |")

    def fmt(p: dict[str, float | None], digits: int) -> str:
        return "/".join("-" if p[k] is None else f"{p[k]:.{digits}f}" for k in ("p50", "p90", "p99"))

    for config in results["served"]:
        for level in config["levels"]:
            cpu = level["cpu_s_per_1k_tokens"]
            vs1 = "" if level["vs_steps1"] is None else f"{level['vs_steps1']:.2f}"
            same = level.get("vs_ceiling_same_threads")
            vs_ceiling = f"{level['vs_ceiling']:.2f}" + ("" if same is None else f" ({same:.2f})")
            lines.append(
                f"| {config['label']} | {level['concurrency']} | {level['tokens_per_s']:.0f} | "
                f"{vs_ceiling} | {vs1} | {level['responses_per_s']:.0f} | "
                f"{fmt(level['ttft_ms'], 1)} | {fmt(level['itl_ms'], 2)} | {level['errors']} | "
                f"{cpu['tritonserver']:.3f}/{cpu['stub']:.3f}/{cpu['client']:.3f} |"
            )
    lines.append("")
    lines.append("| configuration | start to READY s | idle RSS GB (PSS GB) |")
    lines.append("|---|---|---|")
    for config in results["served"]:
        memory = config["idle_memory"]
        lines.append(
            f"| {config['label']} | {config['ready_seconds']:.1f} | {memory['rss_gb']:.2f} ({memory['pss_gb']:.2f}) |"
        )
    lines.append("")
    lines.append("| target | value | limit | met |")
    lines.append("|---|---|---|---|")
    for check in results["targets"]:
        value = "-" if check["value"] is None else f"{check['value']:.3g}"
        sign = "≥" if check["at_least"] else "≤"
        met = {True: "yes", False: "NO", None: "not run"}[check["met"]]
        lines.append(f"| {check['target']} | {value} | {sign} {check['limit']} | {met} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    offline = results["offline"]
    concurrencies = [int(c) for c in offline["llm_generate"]["1"]]
    ax = axes[0]
    for steps, figures in sorted(offline["llm_generate"].items()):
        ax.plot(
            concurrencies,
            [figures[str(c)] for c in concurrencies],
            "k--" if steps == "8" else "k:",
            label=f"offline LLM.generate, steps {steps}",
        )
    served_threads = str(min(offline.get("torch_threads") or [0]))
    same_threads = (offline.get("llm_generate_by_threads") or {}).get("8", {}).get(served_threads)
    if same_threads:
        ax.plot(
            concurrencies,
            [same_threads[str(c)] for c in concurrencies],
            color="tab:purple",
            linestyle="--",
            label=f"offline LLM.generate, steps 8, at the served torch threads ({served_threads})",
        )
    ax.plot(
        concurrencies,
        [offline["forward_only"][str(c)] for c in concurrencies],
        color="grey",
        linestyle="-.",
        label="forward-only ceiling",
    )
    for config in results["served"]:
        xs = [lvl["concurrency"] for lvl in config["levels"]]
        axes[0].plot(xs, [lvl["tokens_per_s"] for lvl in config["levels"]], "o-", label=config["label"])
        axes[1].plot(xs, [lvl["ttft_ms"]["p50"] for lvl in config["levels"]], "o-", label=config["label"])
        axes[2].plot(xs, [lvl["itl_ms"]["p50"] for lvl in config["levels"]], "o-", label=config["label"])
    titles = ("output tokens/s", "time to first token p50 (ms)", "inter-token latency p50 (ms)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"demo model, {results['max_tokens']} tokens per request, greedy, ignore_eos; {results['cpu_count']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--wave-scale", type=float, default=1.0, help="scales the number of waves per level")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 32 only, fewer waves")
    parser.add_argument("--skip-offline", action="store_true", help="reuse the offline figures of --output")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "served.json")
    parser.add_argument("--offline-engine", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.offline_engine:
        offline_engine_process(args.offline_engine, args.max_tokens)
        return
    if args.quick:
        args.concurrency = [1, 32]
        args.wave_scale = 0.5
    from triton_vllm_multistep.demo import models as demo_models

    demo_models.build("tiny-llama-bpe")
    started = time.monotonic()
    engines = None
    if args.skip_offline and args.output.exists():
        offline = json.loads(args.output.read_text())["offline"]
    else:
        engines = OfflineEngines(args.max_tokens)  # built before the servers start, idle meanwhile
    try:
        with tempfile.TemporaryDirectory(prefix="served-bench-") as tmp:
            served = run_served(args.configs, args.concurrency, args.max_tokens, args.wave_scale, Path(tmp), engines)
        if engines is not None:
            offline = engines.results()
    finally:
        if engines is not None:
            engines.close()
    results = {
        "model": "demo://tiny-llama-bpe",
        "max_tokens": args.max_tokens,
        "kv_cache_gib": int(KV_CACHE_GIB),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "command": " ".join(["python -m benchmarks.served_bench", *sys.argv[1:]]),
        "wall_seconds": None,
        "offline": offline,
        "served": served,
    }
    annotate(results)
    results["wall_seconds"] = time.monotonic() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    chart = args.output.with_suffix(".png")
    plot(results, chart)
    table = format_table(results)
    args.output.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"written to {args.output} (and .md, .png) in {results['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
