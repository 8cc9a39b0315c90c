"""GPU smoke test of the engine path: the shipped config's engine, streamed, cancelled, idle, reported.

Owns the checks a user runs once on a GPU host (scripts/gpu_smoke.sh; docs/gpu.md): build the
engine exactly as the backend does (model.json + the config's engine_args → stub.config →
engine.factory.build_engine, driven by engine.loop.EngineLoop), then check per-step streaming,
the final output, cancelling mid-window and the first token after an idle period, and report the
attention backend, CUDA graphs and async output processing vLLM uses. First, the same engine in
a process of its own (engine.process, the backend's default) streams one request; its tokens must
be the in-process engine's. Then the engine with num_scheduler_steps 1, also in a process of its
own, streams the structured-output requests (choice and JSON schema) beside an unconstrained stream:
the in-process engine must give the same tokens, obeying the constraint, one output per step, the
unconstrained stream's tokens those it has alone. `--cpu` runs the same
checks on the CPU engine (what tests/engine/test_gpu_smoke_cpu.py runs). Must not start Triton,
and refuses to run without a GPU unless `--cpu` is given. Takes well under 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton_vllm_multistep.testing.pbtxt import pbtxt_string_parameters

NO_GPU_MESSAGE = "no CUDA device: this script is for GPU hosts (--cpu runs the same checks on the CPU engine)"
WAIT_SECONDS = 120.0  # per wait for an engine event; a healthy engine answers in well under a second
# Structured output (the README's kinds as clients send them; greedy): bounded so that a small model ends them.
CHOICES = ["yes", "no", "not sure"]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "certain": {"type": "boolean"}},
    "required": ["answer", "certain"],
}
CONSTRAINED_MAX_TOKENS = 64


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class SmokeReport:
    engine: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
        return passed


@dataclass
class Stream:
    """What one request streamed: its per-output token deltas and text, how it ended, and the
    indices of the engine steps (StepOutputs events) that carried an output of it."""

    deltas: list[list[int]] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    failure: str | None = None
    steps: set[int] = field(default_factory=set)

    @property
    def tokens(self) -> list[int]:
        return [token for delta in self.deltas for token in delta]

    @property
    def ended(self) -> bool:
        return self.finished or self.failure is not None

    def outcome(self) -> str:
        if self.failure is not None:
            return f"failed: {self.failure}"
        return f"{len(self.tokens)} tokens, finish {self.finish_reason}, text {self.text!r}"


def engine_args_from_config(
    model_dir: Path, config_file: Path, model: str | None = None, overrides: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """(EngineArgs, BackendSettings) as ModelServer derives them from the model folder and config."""
    from triton_vllm_multistep.stub import config

    parameters = pbtxt_string_parameters(config_file.read_text())
    model_config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
    engine_json = config.apply_config_engine_args(config.load_engine_json(model_dir, "1"), model_config)
    if model is not None:
        engine_json["model"] = model
    engine_json.update(overrides or {})
    settings = config.backend_settings(model_config, engine_json)
    return config.engine_args(engine_json, model_dir, settings), settings


def describe_engine(engine: Any) -> dict[str, Any]:
    """What vLLM runs: worker, attention backend, CUDA graphs, async output processing."""
    from vllm.platforms import current_platform

    worker = getattr(getattr(engine.model_executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    base_runner = getattr(runner, "_base_model_runner", runner)
    backend = getattr(runner, "attn_backend", None) or getattr(base_runner, "attn_backend", None)
    graph_runners = getattr(base_runner, "graph_runners", None)
    info: dict[str, Any] = {
        "engine": type(engine).__name__,
        "worker": type(worker).__name__,
        "attention_backend": backend.get_name() if backend is not None else None,
        "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps,
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
        "cuda_graphs_requested": current_platform.is_cuda() and not engine.model_config.enforce_eager,
        "cuda_graph_batch_sizes_captured": len(graph_runners[0]) if graph_runners else 0,
        "async_output_processing": bool(engine.model_config.use_async_output_proc and engine.async_callbacks),
        "tensor_parallel_size": engine.parallel_config.tensor_parallel_size,
    }
    if current_platform.is_cuda():
        capability = current_platform.get_device_capability()
        info["device"] = current_platform.get_device_name()
        info["compute_capability"] = f"{capability.major}.{capability.minor}" if capability else None
    else:
        info["device"] = "cpu"
    return info


class _Collector:
    """The loop's sink: every event, with how many execute_model calls the engine had made by then
    (counted for an engine in this process; None: an engine process's events, not counted)."""

    def __init__(self, engine: Any = None) -> None:
        self.events: queue.Queue[tuple[Any, int]] = queue.Queue()
        self.execute_calls = 0
        self.step_events = 0  # StepOutputs events read by collect()
        if engine is None:
            return
        execute_model = engine.model_executor.execute_model

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.execute_calls += 1
            return execute_model(*args, **kwargs)

        engine.model_executor.execute_model = counted

    def sink(self, event: Any) -> None:
        self.events.put((event, self.execute_calls))

    def outputs_of(self, request_id: str, until_finished: bool = True, count: int | None = None) -> list[tuple]:
        """(RequestOutput, execute calls, arrival perf_counter) of one request, in order."""
        from triton_vllm_multistep.engine.events import RequestFailed, StepOutputs

        collected: list[tuple] = []
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                event, calls = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            now = time.perf_counter()
            if isinstance(event, RequestFailed) and event.request_id == request_id:
                raise RuntimeError(f"request {request_id} failed: {event.message}")
            if not isinstance(event, StepOutputs):
                raise RuntimeError(f"the engine reported {event}")
            for output in event.outputs:
                if output.request_id == request_id:
                    collected.append((output, calls, now))
            if collected and (until_finished and collected[-1][0].finished):
                return collected
            if count is not None and len(collected) >= count:
                return collected
        return collected

    def collect(self, streams: dict[str, Stream], until: Callable[[], bool] | None = None) -> dict[str, Stream]:
        """Read events into `streams` (by request id) until every stream has ended, or `until()`.

        A request the engine fails (RequestFailed: a refusal, a constraint that cannot be built)
        ends with its message; the engine's death ends every stream with its message; a stream
        still open after WAIT_SECONDS without an event ends as failed."""
        from triton_vllm_multistep.engine.events import EngineDied, RequestFailed, StepOutputs

        def done() -> bool:
            return all(stream.ended for stream in streams.values()) or (until is not None and until())

        deadline = time.monotonic() + WAIT_SECONDS
        while not done():
            try:
                event, _ = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for stream in streams.values():
                    if not stream.ended:
                        stream.failure = f"no output for {WAIT_SECONDS:.0f} s"
                break
            deadline = time.monotonic() + WAIT_SECONDS
            if isinstance(event, RequestFailed) and event.request_id in streams:
                streams[event.request_id].failure = event.message
            elif isinstance(event, EngineDied):
                for stream in streams.values():
                    if not stream.ended:
                        stream.failure = event.message
            elif isinstance(event, StepOutputs):
                self.step_events += 1
                for output in event.outputs:
                    stream = streams.get(output.request_id)
                    if stream is None:
                        continue
                    completion = output.outputs[0]
                    stream.deltas.append(list(completion.token_ids))
                    stream.text += completion.text
                    stream.steps.add(self.step_events)
                    if output.finished:
                        stream.finished, stream.finish_reason = True, completion.finish_reason
        return streams


def in_engine_process(engine_args: Any, drive: Callable[[Any, _Collector], Any], **overrides: Any) -> Any:
    """`drive(runner, collector)` on the engine in a process of its own (the backend's default), as
    the stub drives it (`overrides`: engine arguments changed). The process exits before this
    returns, so its device memory is free for the next engine."""
    from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec

    values = {item.name: getattr(engine_args, item.name) for item in dataclasses.fields(engine_args)}
    runner = EngineProcess(EngineSpec({**values, **overrides}, "step"))
    try:
        runner.start_engine()
        collector = _Collector()
        runner.serve(collector.sink)
        return drive(runner, collector)
    finally:
        runner.stop()


def stream_in_engine_process(engine_args: Any, request_id: str, prompt: list[int], params: Any) -> Stream:
    """One streamed request through the engine in a process of its own."""

    def drive(runner: Any, collector: _Collector) -> Stream:
        runner.submit(request_id, prompt, params)
        return collector.collect({request_id: Stream()})[request_id]

    return in_engine_process(engine_args, drive)


def constrained_requests(max_tokens: int = CONSTRAINED_MAX_TOKENS) -> dict[str, Any]:
    """The structured-output requests (request id → SamplingParams), as the stub hands them to the
    engine loop: vLLM's GuidedDecodingParams (backend: the engine's default), streamed, greedy."""
    from vllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

    def constrained(**constraint: Any) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            guided_decoding=GuidedDecodingParams(**constraint),
            output_kind=RequestOutputKind.DELTA,
        )

    return {"structured-choice": constrained(choice=CHOICES), "structured-json": constrained(json=JSON_SCHEMA)}


def stream_beside_constrained(loop: Any, collector: _Collector, prompt: list[int], plain: Any) -> dict[str, Stream]:
    """An unconstrained stream (`plain`), then, once it runs, the structured-output requests beside
    it, through `loop.submit` (EngineLoop or EngineProcess: the constraint is built off the engine
    thread, engine/constraints.py); every stream to its end. Keys: request ids, "structured-beside"
    for the unconstrained one.

    The same constraints go through once first with one token each (the builder loads its
    tokenizer, the guided-decoding backend compiles and caches the grammars), so that those beside
    the unconstrained stream join it within a step or two and a short stream outlasts them."""
    warm_up = {f"{request_id}-warm-up": params for request_id, params in constrained_requests(1).items()}
    for request_id, params in warm_up.items():
        loop.submit(request_id, prompt, params)
    collector.collect({request_id: Stream() for request_id in warm_up})
    streams = {"structured-beside": Stream()}
    loop.submit("structured-beside", prompt, plain)
    collector.collect(streams, until=lambda: bool(streams["structured-beside"].deltas))
    for request_id, params in constrained_requests().items():
        streams[request_id] = Stream()
        loop.submit(request_id, prompt, params)
    return collector.collect(streams)


def single_step_reference(engine_args: Any, prompt: list[int], plain: Any) -> dict[str, Stream]:
    """`stream_beside_constrained` on the same engine with num_scheduler_steps 1, in a process of its
    own (exited on return); an engine that cannot be built or run fails every stream with its error."""
    try:
        return in_engine_process(
            engine_args,
            lambda runner, collector: stream_beside_constrained(runner, collector, prompt, plain),
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        return {request_id: Stream(failure=failure) for request_id in ("structured-beside", *constrained_requests())}


def obeys_constraint(request_id: str, stream: Stream) -> bool:
    """The request ended by its constraint (not max_tokens) and its text is what the constraint allows."""
    if stream.failure is not None or stream.finish_reason != "stop":
        return False
    if request_id == "structured-choice":
        return stream.text in CHOICES
    try:
        document = json.loads(stream.text)
    except json.JSONDecodeError:
        return False
    return isinstance(document, dict) and set(JSON_SCHEMA["required"]) <= set(document)


def check_structured_output(
    report: SmokeReport,
    streams: dict[str, Stream],
    reference: dict[str, Stream],
    alone: list[list[int]],
) -> None:
    """The structured-output checks: obeyed, the tokens of num_scheduler_steps 1, one output per
    step, and the unconstrained stream beside them unchanged (`alone`: its deltas run alone)."""
    constrained = {request_id: streams[request_id] for request_id in constrained_requests()}
    report.check(
        "structured output obeys its constraint (choice, JSON schema)",
        all(obeys_constraint(request_id, stream) for request_id, stream in constrained.items()),
        "; ".join(f"{request_id}: {stream.outcome()}" for request_id, stream in constrained.items()),
    )
    same = {
        request_id: stream.failure is None
        and reference[request_id].failure is None
        and stream.tokens == reference[request_id].tokens
        for request_id, stream in constrained.items()
    }
    report.check(
        "structured output gives the tokens of num_scheduler_steps 1",
        all(same.values()),
        "; ".join(
            f"{request_id}: "
            + (f"{len(stream.tokens)} tokens" if stream.failure is None else f"failed: {stream.failure}")
            + f", equal={same[request_id]} (steps 1: {reference[request_id].outcome()})"
            for request_id, stream in constrained.items()
        ),
    )
    report.check(
        "structured output streams one output per decoded step",
        all(stream.finished and all(len(d) == 1 for d in stream.deltas) for stream in constrained.values()),
        "; ".join(
            f"{request_id}: {len(stream.deltas)} outputs of sizes {sorted({len(d) for d in stream.deltas})}"
            + (f", failed: {stream.failure}" if stream.failure is not None else "")
            for request_id, stream in constrained.items()
        ),
    )
    beside = streams["structured-beside"]
    shared = {request_id: len(stream.steps & beside.steps) for request_id, stream in constrained.items()}
    report.check(
        "an unconstrained stream beside structured output streams the steps it has alone",
        beside.failure is None and beside.deltas == alone and all(shared.values()),
        f"{len(beside.deltas)} outputs, alone {len(alone)}, equal={beside.deltas == alone}; steps shared with "
        + ", ".join(f"{request_id} {count}" for request_id, count in shared.items())
        + (f"; failed: {beside.failure}" if beside.failure is not None else ""),
    )


def run_smoke(engine_args: Any) -> SmokeReport:
    """Build the engine as the backend does and run every check; the report says what passed."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.gpu_multistep import window_open
    from triton_vllm_multistep.engine.loop import EngineLoop

    report = SmokeReport()
    prompt = [1, 5, 9, 12, 20, 33, 47]
    tokens = 3 * engine_args.num_scheduler_steps + 2  # several windows, one partial
    # Outlasts the structured-output requests beside it (stream_beside_constrained).
    beside_tokens = 8 * engine_args.num_scheduler_steps + 2

    def params(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.DELTA) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=kind)

    started = time.perf_counter()
    process_stream = stream_in_engine_process(engine_args, "process-stream", prompt, params(tokens))
    report.figures["engine_process_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    reference = single_step_reference(engine_args, prompt, params(beside_tokens))
    report.figures["single_step_reference_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    loop = EngineLoop(lambda: build_engine(engine_args, stream_mode="step"))
    engine = loop.start_engine()
    report.figures["build_seconds"] = time.perf_counter() - started
    try:
        report.engine = describe_engine(engine)
        print("engine:", json.dumps(report.engine), flush=True)
        steps = engine.scheduler_config.num_scheduler_steps
        report.check("multi-step", steps > 1, f"num_scheduler_steps={steps}, worker {report.engine['worker']}")
        collector = _Collector(engine)
        loop.serve(collector.sink)

        # 1. A fresh request from an idle engine: its first token costs one forward pass.
        loop.submit("warm-up", prompt, params(2))
        collector.outputs_of("warm-up")
        assert loop.settled.wait(WAIT_SECONDS), "the engine did not go idle"
        submitted = time.perf_counter()
        loop.submit("baseline", prompt, params(2))
        first = collector.outputs_of("baseline")[0]
        report.figures["ttft_idle_ms"] = (first[2] - submitted) * 1000

        # 2. Streaming: K tokens over several windows (one partial) → K outputs of one token each.
        loop.submit("stream", prompt, params(tokens))
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
        loop.submit("whole", prompt, params(tokens, RequestOutputKind.FINAL_ONLY))
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
        loop.submit("cancel", prompt, params(10 * steps))
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
        loop.submit("after-cancel", prompt, params(2))
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
        loop.submit("beside-alone", prompt, params(beside_tokens))
        alone = collector.collect({"beside-alone": Stream()})["beside-alone"]
        streams = stream_beside_constrained(loop, collector, prompt, params(beside_tokens))
        check_structured_output(report, streams, reference, alone.deltas)
    finally:
        loop.stop()
        engine.model_executor.shutdown()
    report.figures["total_seconds"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("model_repository/vllm_model"))
    parser.add_argument("--config", type=Path, help="config file (default: config.pbtxt; configs/cpu.pbtxt with --cpu)")
    parser.add_argument("--model", help="model folder or Hugging Face id instead of model.json's")
    parser.add_argument("--engine-args", default="{}", help="JSON object of engine arguments over the config's")
    parser.add_argument("--cpu", action="store_true", help="run the same checks on the CPU engine (no GPU needed)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    options = parser.parse_args(argv)

    from triton_vllm_multistep.stub.device import gpu_count

    if not options.cpu and gpu_count() == 0:
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_USE_V1", "0")
    from vllm.platforms import current_platform

    if options.cpu != current_platform.is_cpu():
        print(
            "--cpu needs vLLM's CPU build"
            if options.cpu
            else f"{NO_GPU_MESSAGE} (vLLM's platform: "
            f"{current_platform.device_name}; install vLLM's CUDA build: scripts/setup.sh --gpu)",
            file=sys.stderr,
        )
        return 2
    config_file = options.config or options.model_dir / ("configs/cpu.pbtxt" if options.cpu else "config.pbtxt")
    engine_args, _ = engine_args_from_config(
        options.model_dir, config_file, options.model, json.loads(options.engine_args)
    )
    report = run_smoke(engine_args)
    print("figures:", json.dumps({k: round(v, 3) for k, v in report.figures.items()}))
    if options.json:
        options.json.write_text(
            json.dumps(
                {"engine": report.engine, "checks": [vars(c) for c in report.checks], "figures": report.figures},
                indent=2,
            )
        )
    print("GPU smoke test", "PASSED" if report.passed else "FAILED")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
