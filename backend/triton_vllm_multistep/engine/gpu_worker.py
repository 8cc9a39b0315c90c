"""The backend's GPU multi-step worker and scheduler: vLLM's MultiStepWorker, MultiStepModelRunner and
V0 scheduler, extended for logits processors (structured output, logit_bias, allowed_token_ids,
bad_words) and for LoRA adapter management.

Owns the scheduler that gives batches holding logits processors windows of one step, the runner
that runs those windows as vLLM runs num_scheduler_steps=1, and the runner's adapter-management
calls; must not change windows without logits processors, and is not used by the CPU engine
(engine/cpu_multistep.py pythonizes every step before the next one's logits, so its windows stay N
steps long).

Why (vLLM 0.8.5, paths relative to vllm/): a logits processor reads its request's output tokens
from the sequence data (model_executor/layers/logits_processor.py `_apply_logits_processors`).
In an N-step window MultiStepModelRunner samples step k+1 on the GPU before step k's token is
pythonized and appended (worker/multi_step_model_runner.py), so the processor would read stale
tokens; vLLM asserts there are none (`_pythonize_sampler_output`) and LLMEngine.add_request
refuses them. In a window of one step, the tokens of every earlier window are in the sequence
data when it is scheduled (the engine appends each window's last token in `_advance_to_next_step`
or `_process_model_outputs` before it schedules again, engine/llm_engine.py), which is exactly
the state single-step vLLM computes from. So: (1) while a running request has logits processors
the scheduler runs with one step and no lookahead slots, as vLLM's scheduler does for
num_scheduler_steps=1 (core/scheduler.py `init_multi_step_from_lookahead_slots`); prefill windows
are one step long in multi-step already; (2) a window of one step holding logits processors is
run by the base GPUModelRunner as at num_scheduler_steps=1 (the sampler pythonizes on the CPU in
that step), through StatefulModelInput.is_multi_step, which the driver broadcasts to
tensor-parallel workers. The cost: the whole batch decodes one step per window while such a
request runs (docs/gpu.md).

LoRA: vLLM 0.8.5's MultiStepModelRunner passes only `remove_all_loras` on to the base runner that
owns the LoRA manager (worker/multi_step_model_runner.py); its own `add_lora`, `remove_lora`,
`pin_lora` and `list_loras` are GPUModelRunnerBase's, whose manager is None under multi-step, so
`LLMEngine.add_lora` and friends raised "LoRA is not enabled" there. The runner passes them on.
Requests carrying a LoRARequest were not affected (the base runner activates their adapters at
every step's `execute_model`, `set_active_loras`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.core.scheduler import Scheduler
from vllm.sequence import SequenceGroup, SequenceGroupMetadata
from vllm.worker.multi_step_model_runner import MultiStepModelRunner, StatefulModelInput
from vllm.worker.multi_step_worker import MultiStepWorker

logger = logging.getLogger(__name__)

SCHEDULER_QUALNAME = f"{__name__}.OneStepWhileConstrainedScheduler"
WORKER_QUALNAME = f"{__name__}.BackendMultiStepWorker"
# Workers that run a one-step window holding logits processors as vLLM's single-step runner does:
# ours on GPU, and the CPU multi-step worker (which pythonizes every step; named, not imported,
# so that GPU hosts never import the CPU runner), on which tests run this scheduler.
ONE_STEP_WINDOW_WORKERS = (WORKER_QUALNAME, "triton_vllm_multistep.engine.cpu_multistep.CPUMultiStepWorker")


def has_logits_processors(params: Any) -> bool:
    """Whether sampling parameters carry logits processors (vLLM turns guided decoding into one)."""
    return params is not None and bool(getattr(params, "logits_processors", None))


def any_constrained(seq_groups: Iterable[SequenceGroup]) -> bool:
    return any(has_logits_processors(group.sampling_params) for group in seq_groups)


def window_is_constrained(seq_group_metadata_list: list[SequenceGroupMetadata]) -> bool:
    """A window holding a request with logits processors; raises if it is longer than one step,
    which the scheduler below never produces (vLLM's runner would then assert deep in a step)."""
    if not any(has_logits_processors(m.sampling_params) for m in seq_group_metadata_list):
        return False
    steps = seq_group_metadata_list[0].state.num_steps if seq_group_metadata_list[0].state else 1
    if steps != 1:
        raise RuntimeError(
            f"a scheduling window of {steps} steps holds a request with logits processors; on GPU such "
            "windows must be one step long (engine/gpu_worker.OneStepWhileConstrainedScheduler)"
        )
    return True


class OneStepWhileConstrainedScheduler(Scheduler):
    """vLLM's V0 scheduler that schedules windows of one step while a running (or swapped-out)
    request has logits processors, and vLLM's N-step windows otherwise."""

    def schedule(self) -> Any:
        config = self.scheduler_config
        if not config.is_multi_step or not (any_constrained(self.running) or any_constrained(self.swapped)):
            return super().schedule()
        # The scheduler reads both on every call (never caches them): one step, no lookahead.
        steps, lookahead = config.num_scheduler_steps, config.num_lookahead_slots
        config.num_scheduler_steps, config.num_lookahead_slots = 1, 0
        try:
            return super().schedule()
        finally:
            config.num_scheduler_steps, config.num_lookahead_slots = steps, lookahead


class BackendMultiStepModelRunner(MultiStepModelRunner):
    """MultiStepModelRunner that runs one-step windows holding logits processors as vLLM runs
    num_scheduler_steps=1: the base runner samples and pythonizes in the step."""

    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        virtual_engine: int = 0,
        finished_requests_ids: list[str] | None = None,
    ) -> StatefulModelInput:
        model_input = super().prepare_model_input(seq_group_metadata_list, virtual_engine, finished_requests_ids)
        # Broadcast with the input, so tensor-parallel workers take the same path.
        model_input.is_multi_step = not window_is_constrained(seq_group_metadata_list)
        return model_input

    def execute_model(  # type: ignore[override]
        self,
        model_input: StatefulModelInput,
        kv_caches: list[Any],
        intermediate_tensors: Any = None,
        num_steps: int = 1,
    ) -> Any:
        if model_input.is_multi_step:
            return super().execute_model(model_input, kv_caches, intermediate_tensors, num_steps)
        # Multi-step windows leave the sampler returning its GPU tensors for deferred
        # pythonization; a single step pythonizes now, as at num_scheduler_steps=1.
        base = self._base_model_runner
        base.sampler.include_gpu_probs_tensor = False
        return base.execute_model(model_input.frozen_model_input, kv_caches, intermediate_tensors, num_steps)

    # Adapter management lives in the base runner's LoRA manager (see the module docstring).
    def add_lora(self, lora_request: Any) -> bool:
        return self._base_model_runner.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._base_model_runner.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._base_model_runner.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._base_model_runner.list_loras()


class BackendMultiStepWorker(MultiStepWorker):
    """vLLM's MultiStepWorker with BackendMultiStepModelRunner as its runner (adds no state)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # MultiStepWorker.__init__ builds its runner around the base runner itself; giving the
        # built object the subclass keeps that construction as vLLM wrote it.
        assert type(self.model_runner) is MultiStepModelRunner, type(self.model_runner)
        self.model_runner.__class__ = BackendMultiStepModelRunner
