"""The load generator: waves of concurrent streams, and what they measured.

Owns the streaming clients (`tritonclient.grpc.aio` for Triton servers, streaming `/v1/completions`
for `vllm serve`), the waves of one concurrency level (interleaved across servers, with the
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

from benchmarks.served import peers
from benchmarks.served.offline import OfflineEngines
from benchmarks.served.settings import MODEL, prompt


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return ordered[index]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


# vLLM's MP engine (`vllm serve`'s, and ours with vLLM's MP executor) spins its core and worker for
# about a second after each message (shm_broadcast's SpinCondition): a wave right after such a
# server's started on CPUs it still held (measured: first tokens ~1 s late in every wave that followed
# `vllm serve`'s). Each measured wave starts once the host is quiet, or after SETTLE_MAX_SECONDS.
QUIET_CPU_PERCENT = 20.0
SETTLE_MAX_SECONDS = 5.0


async def settle() -> float:
    """Seconds waited until the host's CPU use over 0.2 s fell below QUIET_CPU_PERCENT."""
    import psutil

    started = time.perf_counter()
    psutil.cpu_percent(None)
    while time.perf_counter() - started < SETTLE_MAX_SECONDS:
        await asyncio.sleep(0.2)
        if psutil.cpu_percent(None) < QUIET_CPU_PERCENT:
            break
    return time.perf_counter() - started


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


def _make_inputs(grpcaio: Any, text: str, sampling: bytes, count_output: str) -> list[Any]:
    import numpy as np

    text_input = grpcaio.InferInput("text_input", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    stream = grpcaio.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([sampling], dtype=np.object_))
    inputs = [text_input, stream, params]
    if count_output == "num_output_tokens":  # Triton's vLLM backend sends no token ids: ask for the count
        wanted = grpcaio.InferInput("return_num_output_tokens", [1], "BOOL")
        wanted.set_data_from_numpy(np.array([True]))
        inputs.append(wanted)
    return inputs


def _token_count(response: Any, count_output: str) -> int:
    """New tokens in one streamed response, from raw bytes (no numpy per response): output_ids holds
    one INT32 per token; Triton's vLLM backend's num_output_tokens one UINT32 count per sequence."""
    for index, output in enumerate(response.outputs):
        if output.name == count_output:
            raw = response.raw_output_contents[index]
            return len(raw) // 4 if count_output == "output_ids" else int.from_bytes(raw[:4], "little")
    return 0


class TritonStreams:
    """Streams over `tritonclient.grpc.aio`: this backend (token ids in `output_ids`) and Triton's vLLM
    backend (`peers.TRITON_VLLM_BACKEND`: a count in `num_output_tokens`), same inputs otherwise."""

    def __init__(self, url: str, max_tokens: int, peer: bool = False, outputs: list[str] | None = None) -> None:
        import tritonclient.grpc.aio as grpcaio

        self._grpcaio = grpcaio
        self._outputs = outputs  # the outputs to ask for; None: all (the backend builds only those asked)
        self._client = grpcaio.InferenceServerClient(url)
        self._sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        self._count_output = "num_output_tokens" if peer else "output_ids"

    async def request(self, text: str) -> RequestRecord:
        inputs = _make_inputs(self._grpcaio, text, self._sampling, self._count_output)
        record = RequestRecord(sent=time.perf_counter(), arrivals=[], counts=[])

        outputs = None if self._outputs is None else [self._grpcaio.InferRequestedOutput(n) for n in self._outputs]

        async def requests():
            yield {"model_name": MODEL, "inputs": inputs, "outputs": outputs, "enable_empty_final_response": True}

        try:
            # Read to the stream's end, which the server makes right after the FINAL: a stream cancelled
            # as the server finishes it can leave its model unable to unload in Triton 2.51
            # (docs/lifecycle.md, "A stream cancelled as it ends").
            async for result, error in self._client.stream_infer(requests()):
                now = time.perf_counter()
                if error is not None:
                    record.error = record.error or str(error)
                    continue
                response = result.get_response()
                count = _token_count(response, self._count_output)
                if count:
                    record.arrivals.append(now)
                    record.counts.append(count)
        except Exception as error:  # transport errors count as errors, not crashes
            record.error = f"{type(error).__name__}: {error}"
        return record

    async def close(self) -> None:
        await self._client.close()


BACKEND_OPENAI = "backend_openai"  # a configuration served through `serve --openai-port`


class OpenAIStreams:
    """Streaming `/v1/completions` of vLLM's OpenAI server (`peers.VLLM_SERVE`, and ours: `serve
    --openai-port`, BACKEND_OPENAI), the same prompts and
    sampling; token counts from the usage vLLM adds to every chunk (`continuous_usage_stats`)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        import aiohttp

        self._url = f"{url}/v1/completions"
        # The servers (uvicorn) close a connection idle for 5 s; a pooled one kept longer (other
        # servers' waves run in between) fails the next wave's POSTs: keep idle ones 2 s at most.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(keepalive_timeout=2)
        )
        self._body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    async def request(self, text: str) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter(), arrivals=[], counts=[])
        seen = 0
        try:
            async with self._session.post(self._url, json={**self._body, "prompt": text}) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {await response.text()}"
                    return record
                async for line in response.content:
                    now = time.perf_counter()
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if not chunk.get("choices"):
                        continue  # the closing usage-only chunk
                    total = (chunk.get("usage") or {}).get("completion_tokens", seen)
                    if total > seen:
                        record.arrivals.append(now)
                        record.counts.append(total - seen)
                        seen = total
        except Exception as error:
            record.error = f"{type(error).__name__}: {error}"
        return record

    async def close(self) -> None:
        await self._session.close()


def streams_for(
    server: Any, kind: str, max_tokens: int, outputs: list[str] | None = None
) -> TritonStreams | OpenAIStreams:
    """The client of one server: `kind` is "backend" (ours) or one of peers.PEER_KINDS; `outputs`: the
    Triton outputs it asks for (None: all)."""
    if kind in (peers.VLLM_SERVE, peers.VLLM_SERVE_V1):
        return OpenAIStreams(server.http_url, max_tokens)
    if kind == BACKEND_OPENAI:  # ours, through its OpenAI-compatible API: the same client as vllm serve's
        return OpenAIStreams(server.openai_url, max_tokens)
    peer = kind == peers.TRITON_VLLM_BACKEND
    return TritonStreams(f"127.0.0.1:{server.grpc_port}", max_tokens, peer=peer, outputs=outputs)


async def run_wave(streams: TritonStreams | OpenAIStreams, concurrency: int, base: int) -> list[RequestRecord]:
    """`concurrency` streams started together, each with its own prompt; returns when all ended."""
    return await asyncio.gather(*(streams.request(prompt(base + i)) for i in range(concurrency)))


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


def new_tally() -> LevelTally:
    return LevelTally([], [], [], 0.0, dict.fromkeys(("tritonserver", "stub", "engine", "client"), 0.0))


async def run_level(
    servers: dict[str, Any],
    kinds: dict[str, str],
    concurrency: int,
    waves: int,
    max_tokens: int,
    offset: int,
    offline: OfflineEngines | None = None,
    outputs: dict[str, list[str] | None] | None = None,
    tallies: dict[str, LevelTally] | None = None,
) -> dict[str, LevelTally]:
    """Waves at one concurrency on every server, interleaved: wave k runs on each configuration in
    turn (the order rotating), then offline on the same prompts, so that the figures a ratio
    compares are taken seconds apart and a shared host's drift hits them alike. Each server's CPU
    time is counted over its own waves. `kinds`: each server's kind ("backend" or a peer's);
    `outputs`: the outputs each server's client asks for (absent: all). The waves are added to
    `tallies` (a new one per configuration where absent: an earlier pass's waves are kept, in
    order, so that wave k of every configuration still shares a round); `summarize` makes figures."""
    import psutil

    names = list(servers)
    wanted = outputs or {}
    clients = {name: streams_for(servers[name], kinds[name], max_tokens, wanted.get(name)) for name in names}
    groups = {name: servers[name].process_groups() for name in names}
    me = psutil.Process()
    tallies = {} if tallies is None else tallies
    for name in names:
        tallies.setdefault(name, new_tally())
    try:
        for name in names:  # one unmeasured wave each: connections, first-call paths, batch shapes
            await run_wave(clients[name], concurrency, offset)
        for wave in range(waves):
            base = offset + (wave + 1) * concurrency
            for name in names[wave % len(names) :] + names[: wave % len(names)]:
                tally = tallies[name]
                await settle()
                before = _cpu_now(groups[name], me)
                start = time.perf_counter()
                batch = await run_wave(clients[name], concurrency, base)
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
    return tallies


def summarize(tally: LevelTally, concurrency: int, waves: int, max_tokens: int) -> dict[str, Any]:
    """One configuration's figures at one level, over every wave of its tally (`waves`: per pass)."""
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
