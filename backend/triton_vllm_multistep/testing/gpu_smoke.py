"""GPU smoke test of the engine path: the shipped config's engine, streamed, cancelled, idle, reported.

Owns the checks a user runs once on a GPU host (scripts/gpu_smoke.sh; docs/gpu.md): build the
engine exactly as the backend does (model.json + the config's engine_args → settings/ →
engine.factory.build_engine, driven by engine.loop.EngineLoop), then check per-step streaming,
the final output, cancelling mid-window and the first token after an idle period, and report the
attention backend, CUDA graphs and async output processing vLLM uses. First, the same engine in
a process of its own (engine.process, the backend's default) streams one request; its tokens must
be the in-process engine's. Then the engine with num_scheduler_steps 1, also in a process of its
own, streams the structured-output requests (choice and JSON schema) beside an unconstrained stream:
the in-process engine must give the same tokens, obeying the constraint, one output per step, the
unconstrained stream's tokens those it has alone. Last (section "lora", `--only lora` runs it
alone), multi-LoRA: the engine with enable_lora and two adapters (constructed for a Llama-style local
model by testing/lora.py, or the user's with --lora-adapters) runs the base and the adapters in one
batch: each must give its tokens alone and those of num_scheduler_steps 1, the adapters must change
the answer, and (models small enough for transformers on the host) equal the merged-weights
reference; checks that cannot run are reported skipped, with the reason. Section "image" (`--only
image`): the tiny LLaVA demo model (built locally, demo/tiny_llava.py) with the config's engine
arguments: requests with one and two images and a text request in one batch each give their tokens
alone and those of num_scheduler_steps 1 (engine process: images cross its pipe), and the image
changes the answer. `--cpu` runs the same
checks on the CPU engine (what tests/engine/test_gpu_smoke_cpu.py runs). Must not start Triton,
and refuses to run without a GPU unless `--cpu` is given. Takes well under 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
PROMPT = [1, 5, 9, 12, 20, 33, 47]  # token ids: every model has them
SECTIONS = ("engine", "lora", "image")  # --only chooses one
IMAGE_CHECKS = (
    "image batch = num_scheduler_steps 1",
    "image batch = alone",
    "the image changes the answer",
)
# Multi-LoRA: the four checks (each passed, failed or skipped with its reason), the adapters constructed
# for a Llama-style model under test (name → seed, target modules; testing/lora.write_adapter), the
# config fields that needs, vLLM 0.8.5's allowed max_lora_rank values.
LORA_CHECKS = (
    "LoRA: base and adapters mixed in one batch each give their tokens alone",
    "LoRA: base and adapters mixed give the tokens of num_scheduler_steps 1",
    "LoRA: each adapter changes the base model's answer",
    "LoRA: greedy tokens equal transformers with the adapter merged into the weights",
)
LORA_RANK = 8
CONSTRUCTED_ADAPTERS = {
    "smoke-attention": (1, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "smoke-mlp": (2, ("gate_proj", "up_proj", "down_proj", "q_proj")),
}
LLAMA_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)
LORA_MAX_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
TRANSFORMERS_MAX_PARAMS = 2_000_000_000  # the merged-weights reference runs in float32 on the host below this
NEAR_TIE_NATS = 0.5  # a bfloat16/float16 engine against the float32 reference: what counts as a near-tie


@dataclass
class Check:
    """One check's outcome; a skipped check (could not run here, `detail` says why) is not passed."""

    name: str
    passed: bool
    detail: str
    skipped: bool = False


@dataclass
class SmokeReport:
    engine: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def ran(self) -> list[Check]:
        return [check for check in self.checks if not check.skipped]

    @property
    def skipped(self) -> list[Check]:
        return [check for check in self.checks if check.skipped]

    @property
    def passed(self) -> bool:
        """At least one check ran, and every check that ran passed (skipped ones are reported as such)."""
        return bool(self.ran) and all(check.passed for check in self.ran)

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
        return passed

    def skip(self, name: str, reason: str) -> None:
        self.checks.append(Check(name, False, reason, skipped=True))
        print(f"SKIP  {name}: {reason}", flush=True)


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
    """(EngineArgs, BackendSettings) as ModelServer derives them from the model folder and config
    (settings.read_model_settings, then engine.engine_args), with --model and --engine-args over them."""
    from triton_vllm_multistep.engine.engine_args import engine_args_of
    from triton_vllm_multistep.settings import config_with_parameters, read_model_settings

    model_config = config_with_parameters(pbtxt_string_parameters(config_file.read_text()))
    tool_overrides = {**({"model": model} if model is not None else {}), **(overrides or {})}
    settings = read_model_settings(model_dir, "1", model_config, overrides=tool_overrides)
    return engine_args_of(settings), settings.backend


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


def submit(
    runner: Any,
    request_id: str,
    prompt: list[int],
    sampling: dict[str, Any],
    adapter: tuple[str, int, str] | None = None,
    images: Sequence[Any] = (),
) -> None:
    """Every request of the check goes through here, as the stub's codec builds it: one EngineRequest of
    plain values (`sampling`: vLLM SamplingParams field names; `adapter`: (name, lora_int_id, path);
    `images`: PIL images, sent as their files)."""
    from triton_vllm_multistep.engine.events import EngineRequest
    from triton_vllm_multistep.interface import image_file

    files = tuple(image_file(image) for image in images)
    runner.submit(EngineRequest(request_id, tuple(prompt), dict(sampling), adapter=adapter, images=files))


def greedy(max_tokens: int, output_kind: str = "DELTA") -> dict[str, Any]:
    """Greedy sampling fields for `max_tokens` tokens (ignore_eos), streamed ("DELTA") or whole ("FINAL_ONLY")."""
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "output_kind": output_kind}


def in_engine_process(
    engine_args: Any,
    drive: Callable[[Any, _Collector], Any],
    *,
    lora_adapters: tuple[tuple[str, int, str], ...] = (),
    before_serve: Callable[[Any], None] | None = None,
    **overrides: Any,
) -> Any:
    """`drive(runner, collector)` on the engine in a process of its own (the backend's default), as
    the stub drives it (`overrides`: engine arguments changed; `lora_adapters`: (name, lora_int_id,
    path) loaded at start, as multi_lora.json's are; `before_serve(runner)`: requests queued before
    the engine steps, so that they start in one batch). The process exits before this returns, so
    its device memory is free for the next engine."""
    from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec

    values = {item.name: getattr(engine_args, item.name) for item in dataclasses.fields(engine_args)}
    runner = EngineProcess(EngineSpec({**values, **overrides}, "step", lora_adapters=lora_adapters))
    try:
        runner.start_engine()
        collector = _Collector()
        if before_serve is not None:
            before_serve(runner)
        runner.serve(collector.sink)
        return drive(runner, collector)
    finally:
        runner.stop()


def stream_in_engine_process(engine_args: Any, request_id: str, prompt: list[int], params: Any) -> Stream:
    """One streamed request through the engine in a process of its own."""

    def drive(runner: Any, collector: _Collector) -> Stream:
        submit(runner, request_id, prompt, params)
        return collector.collect({request_id: Stream()})[request_id]

    return in_engine_process(engine_args, drive)


def constrained_requests(max_tokens: int = CONSTRAINED_MAX_TOKENS) -> dict[str, Any]:
    """The structured-output requests (request id → sampling fields), as the stub hands them to the
    engine loop: vLLM's GuidedDecodingParams fields (backend: the engine's default), streamed, greedy."""

    def constrained(**constraint: Any) -> dict[str, Any]:
        return {"max_tokens": max_tokens, "temperature": 0.0, "guided_decoding": constraint, "output_kind": "DELTA"}

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
        submit(loop, request_id, prompt, params)
    collector.collect({request_id: Stream() for request_id in warm_up})
    streams = {"structured-beside": Stream()}
    submit(loop, "structured-beside", prompt, plain)
    collector.collect(streams, until=lambda: bool(streams["structured-beside"].deltas))
    for request_id, params in constrained_requests().items():
        streams[request_id] = Stream()
        submit(loop, request_id, prompt, params)
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


def smoke_loop(build: Callable[[], Any], user_threads: dict[str, str | None] | None = None) -> Any:
    """An EngineLoop building its engine with `build`, running it with the served engine's torch thread
    count (engine/factory.serving_torch_threads, as engine/loop.serving_loop applies it: on a CPU host
    all cores but one for a small model; torch's own count on GPU hosts or when the user chose one in
    `user_threads`, what factory.thread_choice_of_user() read before any engine was built here)."""
    from triton_vllm_multistep.engine.factory import serving_torch_threads, thread_choice_of_user
    from triton_vllm_multistep.engine.loop import EngineLoop, model_parameters

    chosen = thread_choice_of_user() if user_threads is None else user_threads
    return EngineLoop(build, lambda engine: serving_torch_threads(model_parameters(engine), chosen))


# --- Multi-LoRA (section "lora") ------------------------------------------------------------------


def parse_lora_adapters(text: str) -> list[tuple[str, Path]]:
    """`--lora-adapters name=path,name=path`: (name, folder) of each, in order; ValueError naming
    what is wrong (a folder without adapter_config.json is not a PEFT adapter)."""
    adapters: list[tuple[str, Path]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, separator, folder = item.partition("=")
        name, folder = name.strip(), folder.strip()
        if not separator or not name or not folder:
            raise ValueError(f"--lora-adapters: {item!r} is not name=path")
        if name in (existing for existing, _ in adapters):
            raise ValueError(f"--lora-adapters: the name {name!r} is given twice")
        path = Path(folder).expanduser().resolve()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"--lora-adapters: {name}: {path} has no adapter_config.json (not a PEFT adapter folder)")
        adapters.append((name, path))
    if not adapters:
        raise ValueError("--lora-adapters names no adapter (name=path,name=path)")
    return adapters


def _adapter_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "adapter_config.json").read_text())


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of the model's safetensors checkpoint, from the files' headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def no_constructed_adapters(model: str, model_dir: Path | None) -> str | None:
    """Why testing/lora.write_adapter cannot construct adapters for the model under test (None: it can)."""
    from triton_vllm_multistep.testing import lora

    bring = "; bring adapters of the model with --lora-adapters name=path,name=path"
    if model_dir is None:
        return f"the model {model!r} has no local folder to construct adapters from{bring}"
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return f"{model_dir} has no config.json to construct adapters from{bring}"
    config = json.loads(config_file.read_text())
    missing = [name for name in LLAMA_CONFIG_FIELDS if not isinstance(config.get(name), int)]
    if missing:
        return (
            f"not a Llama-style model ({', '.join(config.get('architectures') or ['no architectures'])}): its "
            f"config.json lacks {', '.join(missing)}, which constructed adapters need{bring}"
        )
    shapes = _checkpoint_shapes(model_dir)
    if not shapes:
        return f"{model_dir} has no safetensors checkpoint to check constructed adapters against{bring}"
    weights = [
        f"model.layers.0.{'self_attn' if name in lora.ATTENTION else 'mlp'}.{name}.weight"
        for name in (*lora.ATTENTION, *lora.MLP)
    ]
    absent = [weight for weight in weights if weight not in shapes]
    if absent:
        return f"not a Llama-style checkpoint: {model_dir} has no {', '.join(absent)}{bring}"
    return None


def no_merged_reference(model_dir: Path | None, adapters: Sequence[tuple[str, Path]], choice: str) -> str | None:
    """Why the transformers reference with each adapter merged (testing/lora.merged_model) cannot run
    here (None: it can). `choice`: --lora-transformers (auto: models below TRANSFORMERS_MAX_PARAMS)."""
    if choice == "off":
        return "--lora-transformers off"
    if model_dir is None:
        return "the model has no local folder for transformers to load"
    if not (model_dir / "model.safetensors").is_file():
        return f"the merged reference reads one model.safetensors, which {model_dir} does not have (sharded or .bin)"
    for name, folder in adapters:
        config = _adapter_config(folder)
        unusual = [key for key in ("use_dora", "use_rslora", "modules_to_save") if config.get(key)]
        if unusual or not (folder / "adapter_model.safetensors").is_file():
            what = ", ".join(unusual) or "no adapter_model.safetensors"
            return f"adapter {name}: {what} (the merged reference merges plain LoRA pairs, W + alpha/r * B @ A)"
    parameters = sum(math.prod(shape) for shape in _checkpoint_shapes(model_dir).values())
    if choice == "auto" and parameters >= TRANSFORMERS_MAX_PARAMS:
        return (
            f"{parameters / 1e9:.1f}B parameters: too large to run in transformers on the host (auto runs models "
            f"below {TRANSFORMERS_MAX_PARAMS / 1e9:.0f}B; --lora-transformers on runs it anyway)"
        )
    return None


def merged_verdict(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], tokens: list[int], exact: bool
) -> tuple[bool, str]:
    """Whether the engine's greedy `tokens` are transformers' (float32, on the host) with `adapter_dir`
    merged into the weights. `exact` (a float32 engine): token for token. Otherwise (bfloat16/float16
    kernels against float32) equal tokens pass, and where they part, every engine token must be a near-tie
    of the merged model's best along the engine's own sequence (within NEAR_TIE_NATS of its log-probability)."""
    import torch

    from triton_vllm_multistep.testing import lora

    model = lora.merged_model(model_dir, adapter_dir)
    expected = lora.greedy_ids(model, prompt, len(tokens))
    if tokens == expected:
        return True, f"{len(tokens)} tokens equal"
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), len(expected))
    differ = (
        f"differ from token {first} (engine {tokens[first : first + 4]}, transformers {expected[first : first + 4]})"
    )
    if exact or not tokens:
        return False, differ
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logprobs = logits.double().log_softmax(-1)
    gaps = (logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]).tolist()
    worst = max(gaps)
    return worst <= NEAR_TIE_NATS, (
        f"{differ}; along the engine's tokens each is within {worst:.3f} nats of the merged model's best "
        f"(near-tie limit {NEAR_TIE_NATS} for a non-float32 engine)"
    )


def _lora_requests(adapters: Sequence[tuple[str, int, str]]) -> dict[str, tuple[str, int, str] | None]:
    """Request id → adapter (name, lora_int_id, path) (None: the base model): the base first, then each adapter."""
    return {"lora-base": None, **{f"lora-{adapter[0]}": adapter for adapter in adapters}}


def _submit_each(runner: Any, requests: dict[str, Any], prompt: list[int], params: Callable[[], Any]) -> None:
    for request_id, adapter in requests.items():
        submit(runner, request_id, prompt, params(), adapter)


def run_lora_checks(
    report: SmokeReport,
    engine_args: Any,
    lora_adapters: Sequence[tuple[str, Path]] | None = None,
    transformers: str = "auto",
    user_threads: dict[str, str | None] | None = None,
) -> None:
    """The LoRA section: two adapters constructed for the model under test (testing/lora.write_adapter,
    a Llama-style local model; else the checks are skipped, saying why) or the user's (`lora_adapters`),
    the engine built with enable_lora as the engine section builds it and the adapters loaded as the
    backend loads multi_lora.json's (engine/warmup.preload_adapters). Checks: the base and the adapters
    mixed in one batch (greedy, queued before the engine steps) each give their tokens alone; the
    tokens of the same engine at num_scheduler_steps 1 (in a process of its own, run first); each
    adapter changes the base model's answer; the tokens of transformers with the adapter merged
    (`transformers`: auto for models below TRANSFORMERS_MAX_PARAMS, on, off; else skipped, saying why)."""
    from triton_vllm_multistep.settings.lora import local_model_dir

    model_dir = local_model_dir(engine_args.model)
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-lora-") as root:
        if lora_adapters:
            adapters, source = list(lora_adapters), "--lora-adapters"
        else:
            reason = no_constructed_adapters(engine_args.model, model_dir)
            if reason is not None:
                for name in LORA_CHECKS:
                    report.skip(name, reason)
                return
            assert model_dir is not None
            from triton_vllm_multistep.testing import lora

            adapters = [
                (
                    name,
                    lora.write_adapter(model_dir, Path(root) / name, seed=seed, rank=LORA_RANK, target_modules=targets),
                )
                for name, (seed, targets) in CONSTRUCTED_ADAPTERS.items()
            ]
            source = f"constructed (testing/lora.write_adapter, rank {LORA_RANK})"
        _lora_checks(report, engine_args, model_dir, adapters, source, transformers, user_threads)


def _lora_checks(
    report: SmokeReport,
    engine_args: Any,
    model_dir: Path | None,
    adapters: list[tuple[str, Path]],
    source: str,
    transformers: str,
    user_threads: dict[str, str | None] | None,
) -> None:
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.warmup import preload_adapters

    mixed_name, steps1_name, changed_name, merged_name = LORA_CHECKS
    needed = max(int(_adapter_config(folder).get("r") or 0) for _, folder in adapters)
    rank = next((r for r in LORA_MAX_RANKS if r >= needed), needed)
    if engine_args.enable_lora:
        rank = max(rank, engine_args.max_lora_rank)
    lora_args = dataclasses.replace(
        engine_args, enable_lora=True, max_loras=2, max_lora_rank=rank, max_cpu_loras=max(2, len(adapters))
    )
    plain = tuple((name, index + 1, str(folder)) for index, (name, folder) in enumerate(adapters))
    requests = _lora_requests(plain)
    max_tokens = engine_args.num_scheduler_steps + 4  # a prefill step, a whole window and a partial one: short on CPU
    prompt = PROMPT

    def params() -> dict[str, Any]:
        return greedy(max_tokens)

    lora_info = {
        "adapters": {name: str(folder) for name, folder in adapters},
        "source": source,
        "max_loras": 2,
        "max_lora_rank": rank,
    }
    print("LoRA:", json.dumps(lora_info), flush=True)

    # num_scheduler_steps 1, in a process of its own (exited before the in-process engine is built).
    started = time.perf_counter()
    try:
        reference = in_engine_process(
            lora_args,
            lambda runner, collector: collector.collect({request_id: Stream() for request_id in requests}),
            lora_adapters=plain,
            before_serve=lambda runner: _submit_each(runner, requests, prompt, params),
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        reference = {request_id: Stream(failure=failure) for request_id in requests}
    report.figures["lora_single_step_reference_seconds"] = time.perf_counter() - started

    started = time.perf_counter()
    loop = smoke_loop(lambda: preload_adapters(build_engine(lora_args, stream_mode="step"), plain), user_threads)
    try:
        engine = loop.start_engine()
    except Exception as error:
        failure = f"the engine with enable_lora failed to build: {type(error).__name__}: {error}"
        for name in LORA_CHECKS:
            report.check(name, False, failure)
        return
    report.figures["lora_build_seconds"] = time.perf_counter() - started
    try:
        report.engine["lora"] = lora_info
        if "engine" not in report.engine:
            report.engine.update(describe_engine(engine), torch_threads=loop.torch_threads)
            print("engine:", json.dumps(report.engine), flush=True)
        exact = str(engine.model_config.dtype) == "torch.float32"
        collector = _Collector(engine)
        started = time.perf_counter()
        _submit_each(loop, requests, prompt, params)  # queued before the engine steps: one batch from the start
        loop.serve(collector.sink)
        mixed = collector.collect({request_id: Stream() for request_id in requests})
        alone: dict[str, Stream] = {}
        for request_id, adapter in requests.items():
            submit(loop, request_id, prompt, params(), adapter)
            alone[request_id] = collector.collect({request_id: Stream()})[request_id]
        report.figures["lora_generate_seconds"] = time.perf_counter() - started
    finally:
        loop.stop()
        engine.model_executor.shutdown()

    def tokens_of(stream: Stream) -> str:
        return f"{len(stream.tokens)} tokens" if stream.failure is None else f"failed: {stream.failure}"

    def token_list(stream: Stream) -> str:
        return str(stream.tokens) if stream.failure is None else f"failed: {stream.failure}"

    # 1. Mixed in one batch = alone.
    base_steps = mixed["lora-base"].steps
    equal_alone = {
        request_id: stream.failure is None
        and alone[request_id].failure is None
        and len(stream.tokens) == max_tokens
        and stream.tokens == alone[request_id].tokens
        for request_id, stream in mixed.items()
    }
    shared = {request_id: len(stream.steps & base_steps) for request_id, stream in mixed.items()}
    report.check(
        mixed_name,
        all(equal_alone.values()) and all(shared.values()),
        "; ".join(
            f"{request_id}: {tokens_of(stream)}, equal alone={equal_alone[request_id]}"
            + (f" (alone {tokens_of(alone[request_id])})" if not equal_alone[request_id] else "")
            + f", steps shared with lora-base {shared[request_id]}"
            for request_id, stream in mixed.items()
        ),
    )
    # 2. Mixed at num_scheduler_steps N = mixed at 1.
    equal_steps1 = {
        request_id: stream.failure is None
        and reference[request_id].failure is None
        and stream.tokens == reference[request_id].tokens
        for request_id, stream in mixed.items()
    }
    report.check(
        steps1_name,
        all(equal_steps1.values()),
        "; ".join(
            f"{request_id}: {tokens_of(stream)}, equal={equal_steps1[request_id]}"
            + (f" (steps 1: {reference[request_id].outcome()})" if not equal_steps1[request_id] else "")
            for request_id, stream in mixed.items()
        ),
    )
    # 3. Each adapter changes the base model's answer (same prompt).
    base = mixed["lora-base"]
    changed = {
        request_id: base.failure is None and stream.failure is None and stream.tokens != base.tokens
        for request_id, stream in mixed.items()
        if request_id != "lora-base"
    }
    report.check(
        changed_name,
        all(changed.values()),
        f"lora-base: {token_list(base)}; "
        + "; ".join(
            f"{request_id}: {token_list(mixed[request_id])}, changed={changed[request_id]}" for request_id in changed
        ),
    )
    # 4. Greedy tokens = transformers with the adapter merged (small models, on the host).
    reason = no_merged_reference(model_dir, adapters, transformers)
    if reason is not None:
        report.skip(merged_name, reason)
        return
    assert model_dir is not None
    folders = {f"lora-{name}": folder for name, folder in adapters}
    verdicts: dict[str, tuple[bool, str]] = {}
    started = time.perf_counter()
    for request_id, stream in mixed.items():
        if stream.failure is not None:
            verdicts[request_id] = (False, tokens_of(stream))
            continue
        try:
            verdicts[request_id] = merged_verdict(model_dir, folders.get(request_id), prompt, stream.tokens, exact)
        except Exception as error:
            verdicts[request_id] = (False, f"the transformers reference failed: {type(error).__name__}: {error}")
    report.figures["lora_transformers_seconds"] = time.perf_counter() - started
    report.check(
        merged_name,
        all(ok for ok, _ in verdicts.values()),
        "; ".join(f"{request_id}: {detail}" for request_id, (ok, detail) in verdicts.items()),
    )


def run_smoke(
    engine_args: Any,
    sections: Sequence[str] = SECTIONS,
    lora_adapters: Sequence[tuple[str, Path]] | None = None,
    lora_transformers: str = "auto",
) -> SmokeReport:
    """Build the engine as the backend does and run the checks of `sections` ("engine": streaming,
    cancel, idle, engine process, structured output; "lora": multi-LoRA, `run_lora_checks`; "image":
    image prompts, `run_image_checks`); the
    report says what passed and what was skipped, and why."""
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown smoke section(s) {unknown}: choose from {SECTIONS}")
    from triton_vllm_multistep.engine.factory import thread_choice_of_user

    report = SmokeReport()
    started = time.perf_counter()
    user_threads = thread_choice_of_user()  # before this process builds an engine: vLLM sets OMP_NUM_THREADS
    if "engine" in sections:
        run_engine_checks(report, engine_args, user_threads)
    if "lora" in sections:
        if "engine" in sections:
            release_engine_memory()  # the engine section's in-process engine, before the LoRA one is built
        lora_started = time.perf_counter()
        run_lora_checks(report, engine_args, lora_adapters, lora_transformers, user_threads)
        report.figures["lora_seconds"] = time.perf_counter() - lora_started
    if "image" in sections:
        if set(sections) - {"image"}:
            release_engine_memory()
        image_started = time.perf_counter()
        run_image_checks(report, engine_args, user_threads)
        report.figures["image_seconds"] = time.perf_counter() - image_started
    report.figures["total_seconds"] = time.perf_counter() - started
    return report


def _image_requests(model_dir: Path) -> dict[str, tuple[list[int], list[Any]]]:
    """request id → (prompt ids with the model's `<image>` placeholders, images)."""
    from transformers import AutoTokenizer

    from triton_vllm_multistep.testing import multimodal

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    red, noise = multimodal.solid_image(), multimodal.noise_image()
    one, two = tokenizer.encode(multimodal.IMAGE_PROMPT), tokenizer.encode(multimodal.TWO_IMAGE_PROMPT)
    return {
        "image-red": (one, [red]),
        "image-noise": (one, [noise]),
        "image-two": (two, [red, noise]),
        "image-text-only": (tokenizer.encode(multimodal.TEXT_PROMPT), []),
    }


def run_image_checks(report: SmokeReport, engine_args: Any, user_threads: dict[str, str | None] | None = None) -> None:
    """The image section: the tiny LLaVA demo model with the config's engine arguments (dtype, steps,
    attention, ...). Checks: requests with one and two images and a text-only one, queued before the
    engine steps, each give the tokens they give alone and those of num_scheduler_steps 1 (an engine
    process, run first: the images cross its pipe as the backend sends them); the image changes the
    answer."""

    from triton_vllm_multistep.demo import models, tiny_llava
    from triton_vllm_multistep.engine.factory import build_engine

    steps1_name, alone_name, changed_name = IMAGE_CHECKS
    model_dir = models.build(tiny_llava.NAME)
    image_args = dataclasses.replace(
        engine_args,
        model=str(model_dir),
        tokenizer=str(model_dir),
        max_model_len=512,
        limit_mm_per_prompt={"image": 2},
        enable_lora=False,
    )
    requests = _image_requests(model_dir)
    max_tokens = engine_args.num_scheduler_steps + 4  # a prefill step, a whole window and a partial one

    def params() -> dict[str, Any]:
        return greedy(max_tokens)

    def submit_all(runner: Any) -> None:
        for request_id, (prompt, images) in requests.items():
            submit(runner, request_id, prompt, params(), images=images)

    print("image:", json.dumps({"model": str(model_dir), "requests": sorted(requests)}), flush=True)
    try:
        reference = in_engine_process(
            image_args,
            lambda runner, collector: collector.collect({request_id: Stream() for request_id in requests}),
            before_serve=submit_all,
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        reference = {request_id: Stream(failure=failure) for request_id in requests}
    loop = smoke_loop(lambda: build_engine(image_args, stream_mode="step"), user_threads)
    try:
        engine = loop.start_engine()
    except Exception as error:
        for name in IMAGE_CHECKS:
            report.check(name, False, f"the image model's engine failed to build: {type(error).__name__}: {error}")
        return
    try:
        collector = _Collector(engine)
        submit_all(loop)
        loop.serve(collector.sink)
        batch = collector.collect({request_id: Stream() for request_id in requests})
        alone = {}
        for request_id, (prompt, images) in requests.items():
            submit(loop, request_id, prompt, params(), images=images)
            alone[request_id] = collector.collect({request_id: Stream()})[request_id]
    finally:
        loop.stop()
        engine.model_executor.shutdown()

    def same(stream: Stream, other: Stream) -> bool:
        return (
            stream.failure is None
            and other.failure is None
            and len(stream.tokens) == max_tokens
            and (stream.tokens == other.tokens)
        )

    for name, others in ((steps1_name, reference), (alone_name, alone)):
        verdicts = {request_id: same(stream, others[request_id]) for request_id, stream in batch.items()}
        report.check(
            name,
            all(verdicts.values()),
            "; ".join(
                f"{request_id}: {stream.outcome()}, equal={verdicts[request_id]}"
                + ("" if verdicts[request_id] else f" (other: {others[request_id].outcome()})")
                for request_id, stream in batch.items()
            ),
        )
    answers = {request_id: tuple(stream.tokens) for request_id, stream in batch.items() if stream.failure is None}
    report.check(
        changed_name,
        len(answers) == len(requests) and len(set(answers.values())) == len(requests),
        "; ".join(f"{request_id}: {list(tokens)}" for request_id, tokens in answers.items()),
    )


def release_engine_memory() -> None:
    """Free what an in-process engine left behind (shut down, no longer referenced) before another is
    built in this process: vLLM's distributed state, garbage, the CUDA cache (as vLLM's own tests do)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


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
        collector = _Collector(engine)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("model_repository/vllm_model"))
    parser.add_argument("--config", type=Path, help="config file (default: config.pbtxt; configs/cpu.pbtxt with --cpu)")
    parser.add_argument("--model", help="model folder or Hugging Face id instead of model.json's")
    parser.add_argument("--engine-args", default="{}", help="JSON object of engine arguments over the config's")
    parser.add_argument("--cpu", action="store_true", help="run the same checks on the CPU engine (no GPU needed)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--only", choices=SECTIONS, help="run one section's checks (default: all)")
    parser.add_argument(
        "--lora-adapters",
        metavar="NAME=PATH,NAME=PATH",
        help="PEFT LoRA adapters of the model for the LoRA checks (default: two constructed for a Llama-style "
        "local model; other models skip them)",
    )
    parser.add_argument(
        "--lora-transformers",
        choices=("auto", "on", "off"),
        default="auto",
        help="compare LoRA tokens with transformers with the adapter merged, on the host "
        f"(auto: models below {TRANSFORMERS_MAX_PARAMS / 1e9:.0f}B parameters)",
    )
    options = parser.parse_args(argv)
    try:
        lora_adapters = parse_lora_adapters(options.lora_adapters) if options.lora_adapters else None
    except ValueError as error:
        parser.error(str(error))

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
    sections = (options.only,) if options.only else SECTIONS
    report = run_smoke(engine_args, sections, lora_adapters, options.lora_transformers)
    print("figures:", json.dumps({k: round(v, 3) for k, v in report.figures.items()}))
    if options.json:
        options.json.write_text(
            json.dumps(
                {"engine": report.engine, "checks": [vars(c) for c in report.checks], "figures": report.figures},
                indent=2,
            )
        )
    skipped = (
        f" ({len(report.skipped)} of {len(report.checks)} checks skipped, see SKIP above)" if report.skipped else ""
    )
    if not report.ran:
        print(f"GPU smoke test NOT RUN: every check was skipped{skipped}")
        return 2
    print(f"GPU smoke test {'PASSED' if report.passed else 'FAILED'}{skipped}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
