"""What the per-token `vllm:time_per_output_token_seconds` costs the response thread.

`.venv/bin/python -m benchmarks.metrics_cost` drives `BackendMetrics` as the responder does
(one `on_response` per streamed token, a flush per FINAL) over pb_utils stand-ins that count
calls, and prints: Python seconds per token of the metrics path, pb_utils calls per request with
the per-token histogram batched (this backend) and as one `observe()` per token (a pb_utils
HISTOGRAM, what vLLM's own logger amounts to), and what those calls cost at the measured
~19 µs per pb_utils call (README, "Metrics"). Asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from triton_vllm_multistep.stub.metrics import BackendMetrics, RequestTiming

PB_UTILS_CALL_SECONDS = 19e-6  # measured round trip stub → tritonserver, idle host (README)


class _Metric:
    def __init__(self, counter: list[int]) -> None:
        self._counter = counter

    def increment(self, value: float) -> None:
        self._counter[0] += 1

    def set(self, value: float) -> None:
        self._counter[0] += 1

    def observe(self, value: float) -> None:
        self._counter[0] += 1


class CountingPbUtils:
    """pb_utils.MetricFamily stand-in: every metric call counted, nothing else done."""

    def __init__(self) -> None:
        self.calls = [0]
        counter = self.calls

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

            def __init__(self, name: str, description: str, kind: str) -> None:
                pass

            def Metric(self, labels: dict, buckets: Any = None) -> _Metric:
                return _Metric(counter)

        self.MetricFamily = MetricFamily


def run(requests: int, tokens: int, concurrency: int) -> tuple[float, int]:
    """(Python seconds, pb_utils calls) for `requests` streamed requests of `tokens` tokens."""
    pb = CountingPbUtils()
    metrics = BackendMetrics(pb, "m", "1", max_model_len=4096)
    pb.calls[0] = 0
    started = time.perf_counter()
    clock = 0.0
    for first in range(0, requests, concurrency):
        batch = [RequestTiming(clock, 32, True) for _ in range(min(concurrency, requests - first))]
        for step in range(tokens):
            clock += 0.02
            finished = step == tokens - 1
            for timing in batch:
                metrics.on_response(timing, [(0, 1)], finished, clock)
            if finished:
                metrics.flush()
            else:
                metrics.maybe_flush(clock)
    return time.perf_counter() - started, pb.calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    seconds, calls = run(args.requests, args.tokens, args.concurrency)
    total_tokens = args.requests * args.tokens
    per_request_unbatched = args.tokens - 1  # one observe() per token after the first
    print(f"{args.requests} streamed requests × {args.tokens} tokens, {args.concurrency} at a time")
    print(f"Python, whole metrics path: {seconds / total_tokens * 1e6:.2f} µs per token")
    print(f"pb_utils calls, all metrics (batched TPOT): {calls / args.requests:.1f} per request")
    batched_ms = calls / args.requests * PB_UTILS_CALL_SECONDS * 1e3
    print(
        f"pb_utils calls a per-token pb_utils histogram would add: {per_request_unbatched} per request "
        f"= {per_request_unbatched * PB_UTILS_CALL_SECONDS * 1e3:.2f} ms of response-thread time at "
        f"{PB_UTILS_CALL_SECONDS * 1e6:.0f} µs per call, vs {batched_ms:.2f} ms for everything batched"
    )


if __name__ == "__main__":
    main()
