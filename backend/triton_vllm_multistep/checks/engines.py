"""The smoke check's engines: built from a model folder's settings as the backend builds them, and driven.

Owns reading the settings (settings/ + engine/engine_args.py), describing what vLLM runs, the one
`submit` every check's request goes through (an EngineRequest of plain values, as the stub sends),
the engine in a process of its own and the in-process EngineLoop; must not judge outcomes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.pbtxt import pbtxt_string_parameters
from triton_vllm_multistep.checks.report import Stream

PROMPT = [1, 5, 9, 12, 20, 33, 47]  # token ids: every model has them


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
    drive: Callable[[Any, EventCollector], Any],
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
        collector = EventCollector()
        if before_serve is not None:
            before_serve(runner)
        runner.serve(collector.sink)
        return drive(runner, collector)
    finally:
        runner.stop()


def stream_in_engine_process(engine_args: Any, request_id: str, prompt: list[int], params: Any) -> Stream:
    """One streamed request through the engine in a process of its own."""

    def drive(runner: Any, collector: EventCollector) -> Stream:
        submit(runner, request_id, prompt, params)
        return collector.collect({request_id: Stream()})[request_id]

    return in_engine_process(engine_args, drive)


def smoke_loop(build: Callable[[], Any], user_threads: dict[str, str | None] | None = None) -> Any:
    """An EngineLoop building its engine with `build`, running it with the served engine's torch thread
    count (engine/factory.serving_torch_threads, as engine/loop.serving_loop applies it: on a CPU host
    all cores but one for a small model; torch's own count on GPU hosts or when the user chose one in
    `user_threads`, what cpu_placement.thread_choice_of_user() read before any engine was built here)."""
    from triton_vllm_multistep.engine.cpu_placement import thread_choice_of_user
    from triton_vllm_multistep.engine.factory import serving_torch_threads
    from triton_vllm_multistep.engine.loop import EngineLoop, model_parameters

    chosen = thread_choice_of_user() if user_threads is None else user_threads
    return EngineLoop(build, lambda engine: serving_torch_threads(model_parameters(engine), chosen))


# --- Multi-LoRA (section "lora") ------------------------------------------------------------------


def release_engine_memory() -> None:
    """Free what an in-process engine left behind (shut down, no longer referenced) before another is
    built in this process: vLLM's distributed state, garbage, the CUDA cache (as vLLM's own tests do)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
