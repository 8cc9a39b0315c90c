"""The smoke check's engine section: streaming per step, whole, cancel, idle, engine process, structured output.

Owns running those checks on the engine built from the shipped config; the structured-output
section's parts are checks/structured.py's.
"""

from __future__ import annotations

import json
import time
from typing import Any

from triton_vllm_multistep.checks.collector import WAIT_SECONDS, EventCollector
from triton_vllm_multistep.checks.engines import (
    PROMPT,
    describe_engine,
    greedy,
    smoke_loop,
    stream_in_engine_process,
    submit,
)
from triton_vllm_multistep.checks.report import SmokeReport, Stream
from triton_vllm_multistep.checks.structured import (
    check_structured_output,
    single_step_reference,
    stream_beside_constrained,
)


def run_engine_checks(report: SmokeReport, engine_args: Any, user_threads: dict[str, str | None] | None = None) -> None:
    """The engine section: per-step streaming, the final output, cancel, idle, the engine process,
    structured output. The in-process engine is shut down on return."""

    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.gpu_multistep import window_open

    prompt = PROMPT
    tokens = 3 * engine_args.num_scheduler_steps + 2  # several windows, one partial
    # Outlasts the structured-output requests beside it (stream_beside_constrained).
    beside_tokens = 8 * engine_args.num_scheduler_steps + 2

    def params(max_tokens: int, kind: str = "DELTA") -> dict[str, Any]:
        return greedy(max_tokens, kind)

    started = time.perf_counter()
    process_stream = stream_in_engine_process(engine_args, "process-stream", prompt, params(tokens))
    report.figures["engine_process_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    reference = single_step_reference(engine_args, prompt, params(beside_tokens))
    report.figures["single_step_reference_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    loop = smoke_loop(lambda: build_engine(engine_args, stream_mode="step"), user_threads)
    engine = loop.start_engine()
    report.figures["build_seconds"] = time.perf_counter() - started
    try:
        report.engine = {**describe_engine(engine), "torch_threads": loop.torch_threads}
        print("engine:", json.dumps(report.engine), flush=True)
        steps = engine.scheduler_config.num_scheduler_steps
        report.check("multi-step", steps > 1, f"num_scheduler_steps={steps}, worker {report.engine['worker']}")
        collector = EventCollector(engine)
        loop.serve(collector.sink)

        # 1. A fresh request from an idle engine: its first token costs one forward pass.
        submit(loop, "warm-up", prompt, params(2))
        collector.outputs_of("warm-up")
        assert loop.settled.wait(WAIT_SECONDS), "the engine did not go idle"
        submitted = time.perf_counter()
        submit(loop, "baseline", prompt, params(2))
        first = collector.outputs_of("baseline")[0]
        report.figures["ttft_idle_ms"] = (first[2] - submitted) * 1000

        # 2. Streaming: K tokens over several windows (one partial) → K outputs of one token each.
        submit(loop, "stream", prompt, params(tokens))
        streamed = collector.outputs_of("stream")
        deltas = [list(o.outputs[0].token_ids) for o, _, _ in streamed]
        report.check(
            "one output per decoded step",
            len(deltas) == tokens and all(len(d) == 1 for d in deltas),
            f"{tokens} tokens → {len(deltas)} outputs of sizes {sorted({len(d) for d in deltas})}",
        )
        report.check(
            "final output arrives without another request",
            bool(streamed) and streamed[-1][0].finished and streamed[-1][0].outputs[0].finish_reason == "length",
            f"finished={bool(streamed) and streamed[-1][0].finished} with no other request submitted",
        )
        if len(streamed) > 1:
            report.figures["stream_tokens_per_second"] = (len(streamed) - 1) / (streamed[-1][2] - streamed[0][2])
        submit(loop, "whole", prompt, params(tokens, "FINAL_ONLY"))
        whole = collector.outputs_of("whole")
        whole_tokens = list(whole[-1][0].outputs[0].token_ids) if whole else []
        joined = [token for delta in deltas for token in delta]
        report.check(
            "streamed deltas join to the non-streamed result",
            joined == whole_tokens and len(joined) == tokens,
            f"{len(joined)} streamed tokens, {len(whole_tokens)} non-streamed, equal={joined == whole_tokens}",
        )
        report.check(
            "the engine in a process of its own streams the same steps",
            process_stream.deltas == deltas,
            f"{len(process_stream.deltas)} outputs from the engine process, {len(deltas)} in-process, "
            f"equal={process_stream.deltas == deltas}"
            + (f"; failed: {process_stream.failure}" if process_stream.failure is not None else ""),
        )

        # 3. Cancel mid-window: the engine frees the request's blocks and closes its window.
        assert loop.settled.wait(WAIT_SECONDS), "the engine did not go idle"
        total_blocks = loop.kv_cache_stats().total_blocks
        submit(loop, "cancel", prompt, params(10 * steps))
        seen = collector.outputs_of("cancel", until_finished=False, count=3)  # prefill + 2 steps of a window
        loop.abort("cancel")
        settled = loop.settled.wait(WAIT_SECONDS)
        stats = loop.kv_cache_stats()
        report.check(
            "cancel mid-window frees the request's blocks",
            settled and len(seen) == 3 and stats.free_blocks == total_blocks and stats.running == 0,
            f"after {len(seen)} outputs: {stats.free_blocks}/{total_blocks} blocks free, running {stats.running}",
        )
        report.check(
            "no window left open after the cancel", not window_open(engine), f"window open: {window_open(engine)}"
        )

        # 4. The first token after that idle period: its prefill only, no rest of a dead window.
        calls_before, submitted = collector.execute_calls, time.perf_counter()
        submit(loop, "after-cancel", prompt, params(2))
        first = collector.outputs_of("after-cancel")[0]
        report.figures["ttft_after_cancel_ms"] = (first[2] - submitted) * 1000
        report.check(
            "first token after an idle period costs one forward pass",
            first[1] - calls_before == 1,
            f"{first[1] - calls_before} execute_model call(s) before the first token; TTFT "
            f"{report.figures['ttft_after_cancel_ms']:.1f} ms (idle engine: {report.figures['ttft_idle_ms']:.1f} ms)",
        )

        # 5. Structured output through the engine loop (constraint built off the engine thread), beside
        # an unconstrained stream: obeyed, the tokens of steps 1, per step, the other stream unchanged.
        submit(loop, "beside-alone", prompt, params(beside_tokens))
        alone = collector.collect({"beside-alone": Stream()})["beside-alone"]
        streams = stream_beside_constrained(loop, collector, prompt, params(beside_tokens))
        check_structured_output(report, streams, reference, alone.deltas)
    finally:
        loop.stop()
        engine.model_executor.shutdown()
