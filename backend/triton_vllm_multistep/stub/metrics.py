"""Prometheus metrics on Triton's metrics endpoint, through pb_utils.MetricFamily.

Owns metric names, labels, buckets and the batching of updates; must not decide anything from
them. Every pb_utils metric call is a blocking round trip from the stub to tritonserver (about
20 µs idle, more under load), so nothing here calls pb_utils per response: the responder and
engine threads record into plain Python accumulators, and the responder (the one thread that calls
into Triton while it runs, triton_io.TritonCaller, checked by every push) pushes them (`flush()`)
before it sends any FINAL, so a request's counts are on the endpoint by the time its client has
its last response; in between, `maybe_flush()` pushes streaming progress at most every
`FLUSH_SECONDS`, and at once when the engine goes idle.

- The `vllm:` metrics have the names, kinds, buckets and labels (exactly model, version) of
  Triton's vLLM backend. Request-level ones are observed once per finished request;
  `vllm:time_per_output_token_seconds` once per generated token after a sequence's first, as
  vLLM does (latency since the sequence's previous token; tokens that reach the stub together
  share their interval evenly, so count and sum are vLLM's and the spread is per response).
- Per-token and per-step histograms are too frequent for one call each, so they are aggregated
  in Python and exposed as Prometheus histogram series (`NAME_bucket{le=...}`, `NAME_sum`,
  `NAME_count`) built from counters: a flush costs one call per changed bucket however many
  observations it holds, and `histogram_quantile()` works on them.
- Instances of one model version (instance_group count > 1, several GPUs) share each series
  (same name and labels): counters and histograms add up, and gauges are kept as sums too, each
  instance adding the change of its own value (KV-cache usage: the mean over the instances).
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from triton_vllm_multistep.engine.events import KvCacheStats, RequestTimes, StepOutputs
from triton_vllm_multistep.stub.triton_io import TritonCaller

FLUSH_SECONDS = 0.25
# Buckets of Triton's vLLM backend (utils/metrics.py), so dashboards built for it keep working.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
TOKENS_PER_RESPONSE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
# Per-step host times: tens of µs (idle host) to hundreds of ms (an overloaded one).
STEP_SECONDS_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
# vLLM's own (0.8.5's engine/metrics.py; V1 keeps them): tokens per engine step, and the request phases.
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
]  # fmt: skip


def build_1_2_5_buckets(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's buckets for token counts)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return buckets
            buckets.append(float(value))
        exponent += 1


@dataclass
class RequestTiming:
    """What the metrics need to know about one request, kept in the responder's request state."""

    arrival: float  # time.time() when execute() accepted it
    prompt_tokens: int
    stream: bool
    n: int = 1  # completions the client asked for (the `n` sampling parameter)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # completion index → its latest token's time
    generated: int = 0  # tokens of all completions (and best_of candidates) so far


class _BatchedHistogram:
    """A histogram aggregated in Python and published through counters (see the module doc)."""

    def __init__(self, family: Any, name: str, description: str, buckets: list[float], labels: dict) -> None:
        self.bounds = list(buckets)
        bucket_family = family(f"{name}_bucket", f"{description} (cumulative count per upper bound le)")
        self._families = [bucket_family]
        self._bucket_metrics = [
            bucket_family.Metric(labels={**labels, "le": _le(bound)}) for bound in [*self.bounds, math.inf]
        ]
        sum_family = family(f"{name}_sum", f"{description} (sum of observations)")
        count_family = family(f"{name}_count", f"{description} (number of observations)")
        self._families += [sum_family, count_family]
        self._sum_metric = sum_family.Metric(labels=labels)
        self._count_metric = count_family.Metric(labels=labels)
        self._pending = [0] * (len(self.bounds) + 1)
        self._pending_sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self._pending[bisect.bisect_left(self.bounds, value)] += count
        self._pending_sum += value * count

    def flush(self) -> None:
        pending, self._pending = self._pending, [0] * len(self._pending)
        total, self._pending_sum = self._pending_sum, 0.0
        cumulative = 0
        for metric, count in zip(self._bucket_metrics, pending, strict=True):
            cumulative += count
            if cumulative:
                metric.increment(cumulative)
        if cumulative:
            self._count_metric.increment(cumulative)
            self._sum_metric.increment(total)


class _SummedGauge:
    """This instance's share of a gauge that all instances of the model version add to.

    `set()` adds the change of this instance's value (times `weight`), so the series holds the
    sum over instances (weight 1) or their mean (weight 1 / instances).
    """

    def __init__(self, metric: Any, weight: float = 1.0) -> None:
        self._metric = metric
        self._weight = weight
        self._value = 0.0

    def set(self, value: float) -> None:
        change = value - self._value
        if change:
            self._metric.increment(change * self._weight)
            self._value = value


def _never_free(anything: Any) -> None:
    """Keep `anything`, and all it holds, alive until the process ends, interpreter teardown included
    (a reference no Python code owns): its pb_utils metrics then never send a delete to Triton."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(anything))


def _le(bound: float) -> str:
    if math.isinf(bound):
        return "+Inf"
    return f"{bound:g}"


class BackendMetrics:
    """All metrics of one model instance, labelled with model and version like Triton's vLLM backend."""

    def __init__(
        self,
        pb_utils: Any,
        model: str,
        version: str,
        max_model_len: int,
        instances: int = 1,
        caller: TritonCaller | None = None,
        max_loras: int = 0,
        cache_config: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._caller = caller or TritonCaller()
        self.instances = instances
        labels = {"model": model, "version": version}
        kinds = pb_utils.MetricFamily
        # A Metric is only valid while its MetricFamily object lives: keep every family.
        self._families: list[Any] = []

        def family(name: str, description: str, kind: Any) -> Any:
            created = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families.append(created)
            return created

        def gauge(name: str, description: str, weight: float = 1.0) -> _SummedGauge:
            return _SummedGauge(family(name, description, kinds.GAUGE).Metric(labels=labels), weight)

        def counter(name: str, description: str) -> Any:
            return family(name, description, kinds.COUNTER).Metric(labels=labels)

        def histogram(name: str, description: str, buckets: list[float]) -> Any:
            return family(name, description, kinds.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        def batched(name: str, description: str, buckets: list[float]) -> _BatchedHistogram:
            def counter_family(full_name: str, text: str) -> Any:
                return family(full_name, text, kinds.COUNTER)

            return _BatchedHistogram(counter_family, name, description, buckets, labels)

        # Engine state (gauges), sampled by the engine thread at most every 0.25 s.
        self._running = gauge("vllm:num_requests_running", "Number of requests currently running on the engine")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting (or swapped out)")
        self._usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage, 1 = full (CPU memory on CPU hosts; the mean over the model's instances)",
            weight=1.0 / max(1, instances),
        )
        # V1's name for the same figure (vLLM 0.10+): dashboards of either engine's vLLM find it, on either engine.
        self._kv_usage = gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full (vLLM V1's name; the mean over the model's instances)",
            weight=1.0 / max(1, instances),
        )
        self._free = gauge("vllm_multistep:kv_cache_free_blocks", "Free KV-cache blocks")
        self._total = gauge("vllm_multistep:kv_cache_total_blocks", "All KV-cache blocks")
        self._alive = gauge(
            "vllm_multistep:engine_alive", "Instances of the model whose engine runs (1 per instance, 0 once failed)"
        )
        # vLLM V0's name for the device KV cache's hit rate (CPU memory on CPU hosts, as gpu_cache_usage_perc).
        self._prefix_hit_rate = gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prefix-cache block hit rate since start, 0-1, mean over the model's instances (-1: prefix caching off)",
            weight=1.0 / max(1, instances),
        )
        # Engine steps whose outputs wait for the response thread (bounded: the engine waits at the bound).
        self._response_queue = gauge(
            "vllm_multistep:response_queue_steps",
            "Engine steps whose outputs wait for the response thread (the engine waits when the queue is full)",
        )
        self.response_queue_depth: Callable[[], int] | None = None  # set by the owner of the queue
        self._flushed_depth = -1
        # What Triton's vLLM backend reports, under its names.
        self._prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
        token_buckets = build_1_2_5_buckets(max_model_len)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._tpot = batched(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT_BUCKETS
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2E_BUCKETS
        )
        self._request_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        # The request's phases (vLLM's names and meanings), from the engine's own timings of it
        # (engine/events.RequestTimes): waiting = arrival → first scheduled, running = first scheduled
        # → last token, prefill = first scheduled → first token, decode = first token → last token.
        self._phases = [
            histogram(name, description, REQUEST_LATENCY_BUCKETS)
            for name, description in (
                ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
                ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
                ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
                ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
            )
        ]
        self._iteration_tokens = batched(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self._preemptions = counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
        # vLLM's CacheConfig as labels of a gauge at 1 (routers read block_size and num_gpu_blocks).
        info_labels = {key: value for key, value in cache_config if not key.startswith("_")}
        info_family = family("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", kinds.GAUGE)
        self._cache_config_info = _SummedGauge(
            info_family.Metric(labels={**info_labels, **labels}), weight=1.0 / max(1, instances)
        )
        # What only a multi-step backend can show.
        self._windows = counter(
            "vllm_multistep:scheduling_windows_total", "Scheduling rounds (multi-step windows) the engine ran"
        )
        self._tokens_per_response = batched(
            "vllm_multistep:tokens_per_response", "Tokens per streamed response", TOKENS_PER_RESPONSE_BUCKETS
        )
        self._lag = batched(
            "vllm_multistep:pythonization_lag_seconds",
            "Seconds from the end of a step's forward pass until its responses were handed to Triton",
            STEP_SECONDS_BUCKETS,
        )
        self._overhead = batched(
            "vllm_multistep:step_host_overhead_seconds",
            "Host seconds per engine step outside the model's forward pass (schedule, sample, pythonize, outputs)",
            STEP_SECONDS_BUCKETS,
        )
        # vLLM V0's LoRA info gauge (engine/metrics.py): one series per (running adapters, waiting
        # adapters, max_lora) label set, its value the time it was last current; old series stay, as
        # in vLLM. The Kubernetes Gateway API Inference Extension routes LoRA traffic on the newest.
        # Published only with LoRA on (max_loras > 0): Triton's vLLM backend has no such series.
        self._lora_family = (
            family("vllm:lora_requests_info", "Running stats on lora requests.", kinds.GAUGE) if max_loras else None
        )
        self._lora_labels = {**labels, "max_lora": str(max_loras)}
        self._lora_series: dict[tuple[str, str], Any] = {}
        self._alive.set(1)
        self._cache_config_info.set(1)
        self._idle_unflushed = False
        # Accumulators: responder thread only, except `_engine_state` (one reference, swapped whole).
        self._engine_state: KvCacheStats | None = None
        self._flushed_state: KvCacheStats | None = None
        self._prompt_pending = 0
        self._generation_pending = 0
        self._windows_pending = 0
        self._finished: list[tuple[RequestTiming, float, RequestTimes | None]] = []
        self._preemptions_pending = 0
        self._flushed_at = 0.0
        self._gauges = (
            self._running,
            self._waiting,
            self._usage,
            self._kv_usage,
            self._free,
            self._total,
            self._alive,
            self._response_queue,
            self._cache_config_info,
        )
        self._flush_lock = threading.Lock()  # the responder flushes; close() flushes once more

    # --- engine thread -------------------------------------------------------------------
    def update_engine_state(self, stats: KvCacheStats) -> None:
        self._engine_state = stats
        if stats.running == 0 and stats.waiting == 0:
            self._idle_unflushed = True  # the responder flushes at once: nothing more is coming

    # --- responder thread ----------------------------------------------------------------
    def on_response(
        self,
        timing: RequestTiming,
        tokens_per_completion: Iterable[tuple[int, int]],
        finished: bool,
        now: float,
        engine_first_token: float | None = None,
        unreturned: tuple[int, int] = (0, 0),
        times: RequestTimes | None = None,
    ) -> None:
        """A response carrying new tokens, as (completion index, count) pairs, is about to go to a client.

        `engine_first_token` (time.time()) is the engine's own first-token time, for responses
        that are not streamed and so arrive only once everything is generated. `unreturned` is
        (tokens, sequences) of best_of candidates the engine generated and did not return; vLLM
        counts them as generated tokens. `times`: the engine's timings of a finished request.
        """
        if timing.first_token_at is None:
            tokens_per_completion = [(index, count) for index, count in tokens_per_completion if count]
            if tokens_per_completion or finished:
                self._prompt_pending += timing.prompt_tokens
            if tokens_per_completion:
                timing.first_token_at = now if engine_first_token is None else min(now, engine_first_token)
        first = timing.first_token_at
        last_token_at = timing.last_token_at
        observe = self._tpot.observe
        tokens = 0
        for index, count in tokens_per_completion:
            if not count:
                continue
            tokens += count
            previous = last_token_at.get(index)
            if previous is None:
                previous, gaps = first, count - 1  # a sequence's first token is time to first token
            else:
                gaps = count
            if gaps > 0:
                observe(max(0.0, now - previous) / gaps, gaps)
            last_token_at[index] = now
        unreturned_tokens, unreturned_sequences = unreturned
        if unreturned_tokens and first is not None:
            gaps = unreturned_tokens - unreturned_sequences
            if gaps > 0:
                self._tpot.observe(max(0.0, now - first) * unreturned_sequences / gaps, gaps)
        tokens += unreturned_tokens
        if tokens:
            timing.generated += tokens
            self._generation_pending += tokens
            if timing.stream:
                self._tokens_per_response.observe(tokens)
        if finished:
            self._finished.append((timing, now, times))

    def on_step(self, event: StepOutputs, sent_at: float) -> None:
        """One engine step's outputs were all handed to Triton at `sent_at` (perf_counter)."""
        if event.new_window:
            self._windows_pending += 1
        if event.iteration_tokens is not None:
            self._iteration_tokens.observe(event.iteration_tokens)
        self._preemptions_pending += event.preemptions
        # Forward-pass times are measured on CPU hosts only (None on GPU): both series stay empty there.
        if event.forward_end is not None and event.outputs:
            self._lag.observe(max(0.0, sent_at - event.forward_end))
        if event.forward_seconds is not None:
            self._overhead.observe(max(0.0, event.step_seconds - event.forward_seconds))

    def on_engine_died(self) -> None:
        """The engine has failed: say so at once, before its requests get their errors (responder thread)."""
        self._caller.check("reporting the engine's failure")
        with self._flush_lock:
            self._engine_state = None
            self._alive.set(0)
            self._running.set(0)
            self._waiting.set(0)

    def close(self, shared: bool = False) -> None:
        """Push what is pending, take this instance's share out of the gauges, then delete this
        instance's series from the endpoint, unless another stub may hold the same series (`shared`).

        Why not always: in tritonserver 2.51 every stub's MetricFamily is a core object of its own
        over one Prometheus family, and each counts references to a series by itself
        (core src/metric_family.cc, MetricFamily::Remove): the first stub to delete a series that
        another stub of the same model and version also holds (a second instance, or the new copy
        of a model being reloaded) frees it under the other, whose next update writes into freed
        memory (seen in CI: the unload of a two-instance model, then "malloc(): unaligned fastbin
        chunk detected", SIGABRT, tritonserver wedged). A shared series is therefore left on the
        endpoint at this instance's share of 0 (counters keep their totals) and its objects are
        never freed in this process, so no delete is ever sent for them.
        """
        self._caller.check("closing the metrics")
        with self._flush_lock:
            if shared:
                self._flush()
                for gauge in self._gauges:
                    gauge.set(0)
                _never_free(self)
                return
            try:
                self._flush()
                for gauge in self._gauges:
                    gauge.set(0)  # take this instance's share out of series other instances keep
            finally:
                # Metrics first, their families after (pb_utils requires that order).
                keep = ("_flush_lock", "_families")
                for name in [n for n, v in vars(self).items() if n not in keep and not isinstance(v, int | float)]:
                    setattr(self, name, None)
                gc.collect()
                self._families = []
                gc.collect()

    def maybe_flush(self, now: float | None = None) -> None:
        """Push streaming progress at most every FLUSH_SECONDS, and everything once the engine goes idle."""
        now = time.monotonic() if now is None else now
        if self._idle_unflushed or now - self._flushed_at >= FLUSH_SECONDS:
            self._idle_unflushed = False
            self._flushed_at = now
            self.flush()

    def flush(self) -> None:
        """Push everything accumulated since the last flush (a few pb_utils calls)."""
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        self._caller.check("pushing metrics")
        if self._prompt_pending:
            self._prompt_tokens.increment(self._prompt_pending)
            self._prompt_pending = 0
        if self._generation_pending:
            self._generation_tokens.increment(self._generation_pending)
            self._generation_pending = 0
        if self._windows_pending:
            self._windows.increment(self._windows_pending)
            self._windows_pending = 0
        if self._preemptions_pending:
            self._preemptions.increment(self._preemptions_pending)
            self._preemptions_pending = 0
        finished, self._finished = self._finished, []
        for timing, ended, times in finished:
            if times is not None and None not in times[:4]:
                arrival, scheduled, first, last = times[:4]
                for histogram, seconds in zip(
                    self._phases, (scheduled - arrival, last - scheduled, first - scheduled, last - first), strict=True
                ):
                    histogram.observe(max(0.0, seconds))
            self._e2e.observe(max(0.0, ended - timing.arrival))
            self._request_prompt.observe(timing.prompt_tokens)
            self._request_generation.observe(timing.generated)
            self._params_n.observe(timing.n)
            if timing.first_token_at is not None:
                self._ttft.observe(max(0.0, timing.first_token_at - timing.arrival))
        for histogram in (self._tpot, self._tokens_per_response, self._lag, self._overhead, self._iteration_tokens):
            histogram.flush()
        if self.response_queue_depth is not None and (depth := self.response_queue_depth()) != self._flushed_depth:
            self._flushed_depth = depth
            self._response_queue.set(depth)
        state = self._engine_state
        if state is not None and state != self._flushed_state:
            self._flushed_state = state
            self._running.set(state.running)
            self._waiting.set(state.waiting)
            self._free.set(state.free_blocks)
            self._total.set(state.total_blocks)
            used = state.total_blocks - state.free_blocks
            usage = used / state.total_blocks if state.total_blocks else 0.0
            self._usage.set(usage)
            self._kv_usage.set(usage)
            self._prefix_hit_rate.set(state.prefix_cache_hit_rate)
        if state is not None and self._lora_family is not None:
            self._set_lora_info(state)

    def _set_lora_info(self, state: KvCacheStats) -> None:
        """The current adapter label set's series to now (vLLM: `set_to_current_time` at each stats log)."""
        key = (state.running_lora_adapters, state.waiting_lora_adapters)
        series = self._lora_series.get(key)
        if series is None:
            labels = {**self._lora_labels, "running_lora_adapters": key[0], "waiting_lora_adapters": key[1]}
            series = self._lora_series[key] = self._lora_family.Metric(labels=labels)
        series.set(time.time())
