"""The load generator: waves of concurrent streams over `tritonclient.grpc.aio`, and what they measured.

Owns the streaming client, the waves of one concurrency level (interleaved across servers, with the
offline engines measured between rounds), CPU accounting and the per-level figures; must not start
or stop servers.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.served.offline import OfflineEngines
from benchmarks.served.settings import MODEL, prompt
from triton_vllm_multistep.testing.local_server import ServerProcess


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


def cpu_seconds(procs: list[Any]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except Exception:
            continue
        total += times.user + times.system
    return total


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
        "engine": cpu_seconds(groups["engine"]),
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
        name: LevelTally([], [], [], 0.0, dict.fromkeys(("tritonserver", "stub", "engine", "client"), 0.0))
        for name in names
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
