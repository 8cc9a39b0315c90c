"""vLLM's own V0 multi-step path on CUDA: what the backend checks at load and adds to the engine.

Owns (1) the load-time check that vLLM's multi-step model runner will accept the attention
backend vLLM is about to choose, with an error naming the setting and the fix, and (2) the engine
subclass that closes a scheduling window whose requests have all finished or were aborted;
must not change what vLLM computes for live requests, and is not used by the CPU engine.

Every decision here follows vLLM 0.8.5's source (paths relative to vllm/): the attention choice
is `attention/selector.py` → `platforms/cuda.py` `get_attn_backend_cls`, the accepted backends
are `worker/multi_step_model_runner.py`'s, and the window logic mirrors `LLMEngine.step`
(`engine/llm_engine.py`). No GPU ran this code here; tests/engine/test_gpu_config_simulated.py
runs it under vLLM's CUDA platform simulated, and tests/engine/test_gpu_windows.py runs the
window logic against vLLM's own engine state objects.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.llm_engine import LLMEngine

from triton_vllm_multistep.engine.constraints import add_request_past_multi_step_check, needs_logits_processors

logger = logging.getLogger(__name__)

# What `platforms/cuda.py` needs for FlashAttention-2 (V0), besides an importable vllm_flash_attn.
FLASH_ATTN_MIN_CAPABILITY = 80
FLASH_ATTN_DTYPES = ("float16", "bfloat16")


def chosen_attention_backend(config: VllmConfig) -> str | None:
    """The attention backend vLLM's GPU model runner will choose for `config`, by vLLM's own selector.

    Same call and arguments as `GPUModelRunnerBase.__init__` (worker/model_runner.py); None when
    that runner would choose none (a model without attention heads).
    """
    from vllm.attention.selector import get_attn_backend

    model = config.model_config
    if model.get_num_attention_heads(config.parallel_config) == 0 and not model.is_attention_free:
        return None
    backend = get_attn_backend(
        model.get_head_size(),
        model.dtype,
        config.cache_config.cache_dtype,
        config.cache_config.block_size,
        model.is_attention_free,
        use_mla=model.use_mla,
    )
    return backend.get_name()


def multi_step_attention_backends(config: VllmConfig) -> list[str]:
    """The backends vLLM's MultiStepModelRunner accepts for `config` (its own list)."""
    from vllm.worker.multi_step_model_runner import _get_supported_attention_backends

    return list(_get_supported_attention_backends(config.scheduler_config.chunked_prefill_enabled))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _why_not_flash_attention(config: VllmConfig, chosen: str, accepted: list[str]) -> str:
    """Which input of vLLM's CUDA attention choice made it pick `chosen`, and the fix.

    Checks the conditions in the order `CudaPlatform.get_attn_backend_cls` does (V0 path).
    """
    import vllm.envs as envs
    from vllm.attention.selector import get_global_forced_attn_backend
    from vllm.platforms import current_platform

    model = config.model_config
    steps = config.scheduler_config.num_scheduler_steps
    runner = (
        f"vLLM 0.8.5's multi-step runner (num_scheduler_steps={steps}) accepts only {', '.join(accepted)}, "
        f"and vLLM would choose {chosen} on this GPU"
    )
    forced = get_global_forced_attn_backend()
    if forced is not None or envs.VLLM_ATTENTION_BACKEND:
        source = f"VLLM_ATTENTION_BACKEND={envs.VLLM_ATTENTION_BACKEND}" if forced is None else f"forced {forced}"
        return f"{source} selects {chosen}: {runner}; unset it or choose one of {', '.join(accepted)}"
    if model.use_mla:
        return f"the model uses multi-head latent attention (MLA): {runner}; set num_scheduler_steps to 1"
    capability = current_platform.get_device_capability()
    if capability is not None and capability.to_int() < FLASH_ATTN_MIN_CAPABILITY:
        return (
            f"{current_platform.get_device_name()} has compute capability {capability.major}.{capability.minor}; "
            f"vLLM's FlashAttention needs 8.0 or newer, so {runner}: set num_scheduler_steps to 1, or "
            "VLLM_ATTENTION_BACKEND=FLASHINFER if FlashInfer is installed and supports this GPU"
        )
    dtype = _dtype_name(model.dtype)
    if dtype not in FLASH_ATTN_DTYPES:
        return (
            f"dtype {dtype} makes vLLM choose {chosen} on CUDA, which its multi-step runner does not support "
            f"(it accepts {', '.join(accepted)}): set the engine argument dtype to bfloat16 or float16 "
            "(config.pbtxt parameter engine_args, or model.json)"
        )
    block_size = config.cache_config.block_size
    if block_size % 16:
        return f"block_size {block_size} is not a multiple of 16, so {runner}: set block_size to 16 (or a multiple)"
    try:
        import vllm.vllm_flash_attn  # noqa: F401
        from vllm.attention.backends.flash_attn import FlashAttentionBackend
    except ImportError:
        return (
            f"this vLLM installation has no vllm.vllm_flash_attn, so {runner}: install vLLM's CUDA wheel "
            "(scripts/setup.sh --gpu, or the Docker image)"
        )
    head_size = model.get_head_size()
    if head_size not in FlashAttentionBackend.get_supported_head_sizes():
        return (
            f"the model's attention head size {head_size} is not one FlashAttention supports, so {runner}: "
            "set num_scheduler_steps to 1, or VLLM_ATTENTION_BACKEND=FLASHINFER if FlashInfer is installed"
        )
    if str(config.cache_config.cache_dtype).startswith("fp8"):
        return (
            f"kv_cache_dtype {config.cache_config.cache_dtype}: {runner}; set kv_cache_dtype to auto, or "
            "VLLM_ATTENTION_BACKEND=FLASHINFER if FlashInfer is installed"
        )
    return f"{runner}: set VLLM_ATTENTION_BACKEND to one of {', '.join(accepted)}, or num_scheduler_steps to 1"


def multi_step_attention_problem(config: VllmConfig) -> str | None:
    """Why vLLM's MultiStepModelRunner would refuse `config`'s attention backend, or None if it accepts it.

    vLLM raises that refusal only inside `MultiStepWorker.__init__`, after the executor started
    building workers; this answers the same question from the config, before anything is built.
    """
    if not config.scheduler_config.is_multi_step:
        return None
    chosen = chosen_attention_backend(config)
    if chosen is None:
        return None
    accepted = multi_step_attention_backends(config)
    if chosen in accepted:
        return None
    return _why_not_flash_attention(config, chosen, accepted)


# --- scheduling windows ------------------------------------------------------------------------
# vLLM's LLMEngine.step() does not schedule while the cached window has steps left
# (`_has_remaining_steps`), whether or not its requests are still alive, so the rest of a window
# whose requests all finished or were aborted runs on the next step() call: up to N-1 forward
# passes in front of the next request's prefill.


def window_open(engine: LLMEngine) -> bool:
    """The engine's cached scheduling window has steps left (the next step() continues it)."""
    return engine._has_remaining_steps(engine.cached_scheduler_outputs[0].seq_group_metadata_list)


def window_dead(engine: LLMEngine) -> bool:
    """The open window holds only finished or aborted requests.

    Not while vLLM re-runs a schedule after an InputProcessingError (`_skip_scheduling_next_step`):
    that schedule's requests are alive.
    """
    cached = engine.cached_scheduler_outputs[0]
    if engine._skip_scheduling_next_step or cached.scheduler_outputs is None:
        return False
    # Cheapest test first (it stops at the first live request, the common case): runs every step.
    if not all(scheduled.seq_group.is_finished() for scheduled in cached.scheduler_outputs.scheduled_seq_groups):
        return False
    return window_open(engine)


def close_dead_window(engine: LLMEngine, step: Any = None) -> list[Any] | None:
    """Run a dead window's last step now, instead of its remaining steps; None if it is not dead.

    Moves every group's step counter to the window's last step, then runs one `step()`: its
    ExecuteModelRequest has `is_last_step` (remaining_steps == 1), so vLLM's own last-step path
    runs: the worker's `_final_process_outputs` pythonizes and releases the window, the engine
    clears its cached window, drains its output queue and, with nothing left to run, stops the
    remote workers' execution loop. One forward pass instead of N-k. `step` is the step function
    to call (an engine subclass passes its parent's). Returns that step's outputs.
    """
    if not window_dead(engine):
        return None
    for metadata in engine.cached_scheduler_outputs[0].seq_group_metadata_list:
        state = metadata.state
        state.current_step = state.num_steps - 1
    return list((step or engine.step)())


def finish_open_window(engine: LLMEngine, step: Any = None) -> list[Any]:
    """Bring the engine to a window boundary: close a dead window at once, run out a live one."""
    closed = close_dead_window(engine, step)
    if closed is not None:
        return closed
    outputs: list[Any] = []
    run = step or engine.step
    # A live window ends within its own num_steps; the bound only guards against a stuck state.
    for _ in range(engine.scheduler_config.num_scheduler_steps):
        if not window_open(engine):
            break
        outputs.extend(run())
    return outputs


class WindowClosingEngine(LLMEngine):
    """vLLM's V0 LLMEngine (MultiStepWorker on CUDA) that does not run dead windows out, and that
    admits requests with logits processors (structured output) when its scheduler and worker run
    them in one-step windows (engine/gpu_worker.py).

    Before each step, a window whose requests have all finished or been aborted is closed with
    one forward pass (see `close_dead_window`); `close_window()` lets the engine loop do the same
    when it goes idle, so neither the next request's first token nor the remote workers wait on it.
    """

    def add_request(self, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        if needs_logits_processors(params) and self.runs_logits_processors_exactly():
            add_request_past_multi_step_check(self, super().add_request, request_id, prompt, params, *args, **kwargs)
        else:  # vLLM's own add_request, and its refusal where the window would not be exact
            super().add_request(request_id, prompt, params, *args, **kwargs)

    def runs_logits_processors_exactly(self) -> bool:
        """Single-step, or multi-step with the one-step-window scheduler and a worker that runs a
        one-step window as vLLM's single-step runner does (engine/gpu_worker.py)."""
        from triton_vllm_multistep.engine import gpu_worker

        if not self.scheduler_config.is_multi_step:
            return True
        return self.parallel_config.worker_cls in gpu_worker.ONE_STEP_WINDOW_WORKERS and all(
            isinstance(scheduler, gpu_worker.OneStepWhileConstrainedScheduler) for scheduler in self.scheduler
        )

    def step(self) -> list[Any]:
        closed = close_dead_window(self, super().step) if self.scheduler_config.is_multi_step else None
        outputs = super().step()
        if closed:  # normally empty: its requests had finished
            return [*closed, *outputs]
        return outputs

    def close_window(self) -> list[Any]:
        """Called by the engine loop with no unfinished requests: end any window left open."""
        if not self.scheduler_config.is_multi_step:
            return []
        return finish_open_window(self, super().step)
