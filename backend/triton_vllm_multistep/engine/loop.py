"""The engine thread: builds the `LLMEngine` and is the only code that drives it.

Owns running the engine build in its thread, admitting and aborting requests between steps and
calling `step()`; must not build or send Triton responses (it hands each step's outputs, as the
boundary's plain EngineOutputs, to a sink and returns to the engine). Requests are prepared for
admission by engine/admission.py.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.worker.model_runner_base import InputProcessingError

from triton_vllm_multistep.engine.admission import Admissions
from triton_vllm_multistep.engine.cpu_attention import attention_kernels
from triton_vllm_multistep.engine.events import (
    EngineDied,
    EngineEvent,
    EngineFacts,
    EngineRequest,
    KvCacheStats,
    RequestFailed,
    StepOutputs,
)
from triton_vllm_multistep.engine.factory import build_engine, driver_model_runner, serving_torch_threads
from triton_vllm_multistep.engine.multimodal import images_per_prompt
from triton_vllm_multistep.engine.outputs import plain_outputs
from triton_vllm_multistep.engine.prefix_cache import prefix_cache_hit_rate
from triton_vllm_multistep.engine.warmup import preload_adapters, warmed_up
from triton_vllm_multistep.interface import EMBED_TASK, GENERATE_TASK
from triton_vllm_multistep.settings.backend import StreamMode

logger = logging.getLogger(__name__)


def driver_model(engine: LLMEngine):
    """The torch module the in-process (driver) worker runs, or None if it cannot be found."""
    model = getattr(driver_model_runner(engine), "model", None)
    return model if hasattr(model, "register_forward_hook") else None


def lora_adapter_names(queues: Iterable[Iterable[Any]]) -> str:
    """The adapter names of the requests in `queues`, each once in first-seen order, comma-joined: the
    label value vLLM V0's `_get_stats` and stat logger give vllm:lora_requests_info."""
    names = dict.fromkeys(g.lora_request.lora_name for queue in queues for g in queue if g.lora_request)
    return ",".join(names)


def engine_facts(engine: LLMEngine) -> EngineFacts:
    """What the stub needs to know of a built engine (read where the engine lives)."""
    model = engine.model_config
    steps = int(engine.scheduler_config.num_scheduler_steps)
    return EngineFacts(
        model=str(model.model),
        vocab_size=int(model.get_vocab_size()),
        max_model_len=int(model.max_model_len),
        multimodal=bool(getattr(model, "is_multimodal_model", False)),
        images_per_prompt=images_per_prompt(model),
        num_scheduler_steps=steps,
        attention_kernels=attention_kernels(),
        max_loras=engine.lora_config.max_loras if engine.lora_config else 0,
        scheduling_policy=str(engine.scheduler_config.policy),
        cache_config=tuple(engine.cache_config.metrics_info().items()),
        tasks=(EMBED_TASK if model.runner_type == "pooling" else GENERATE_TASK,),
    )


def window_tokens(scheduled: Any) -> tuple[int, int]:
    """Tokens through the model in the first step of a scheduling window, and in each further step
    (vLLM V0's num_tokens_iter at steps 1: prompt tokens prefilled plus one per sequence producing a
    token; a multi-step window's further steps decode every sequence of its batch). Read right after
    the window's first step, when a prefill that completed is no longer `is_prefill()`."""
    groups = scheduled.scheduled_seq_groups
    prefills = scheduled.num_prefill_groups
    prompt = sum(group.token_chunk_size for group in groups[:prefills])
    producing = sum(
        g.seq_group.num_seqs() for i, g in enumerate(groups) if i >= prefills or not g.seq_group.is_prefill()
    )
    decoding = sum(group.seq_group.num_seqs() for group in groups)
    return prompt + producing, decoding


def model_parameters(engine: LLMEngine) -> int | None:
    """Parameters of the driver worker's model (its shard under tensor parallel), or None if not found."""
    model = driver_model(engine)
    return None if model is None else sum(p.numel() for p in model.parameters())


def module_hooks_time_the_forward_pass(engine: LLMEngine) -> bool:
    """Whether torch module hooks around the driver model measure its forward pass: on CPU only.

    On CPU the module call is the computation. On CUDA it is not: a captured CUDA graph is
    replayed without calling the module (vLLM's CUDAGraphRunner), and an eager call returns once
    its kernels are queued, so hooks would time kernel launches. vLLM's own GPU forward timing
    (collect_detailed_traces) synchronises every step, which defeats multi-step's overlap.
    """
    device = getattr(getattr(engine, "device_config", None), "device", None)
    return getattr(device, "type", None) == "cpu"


def settle_idle_engine(engine: LLMEngine) -> list[RequestOutput]:
    """Bring an engine with no unfinished requests to rest; returns outputs that produced (usually none).

    Ends a scheduling window left open (vLLM would otherwise run its remaining steps in front of
    the next request), then stops
    the remote workers' execution loop (tensor parallel: they busy-wait for the next step
    otherwise); the latter is a no-op with no remote workers or no loop running.
    """
    close_window = getattr(engine, "close_window", None)
    outputs = list(close_window()) if close_window is not None else []
    engine.model_executor.stop_remote_worker_execution_loop()
    return outputs


class ForwardClock:
    """Times the driver model's forward passes with torch module hooks (no method patching).

    Right on CPU only (see `module_hooks_time_the_forward_pass`); not installed on GPU hosts.
    """

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self.last_end: float | None = None
        self._started = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_: object) -> None:
        self._started = time.perf_counter()

    def _post(self, *_: object) -> None:
        self.last_end = time.perf_counter()
        self.seconds += self.last_end - self._started

    def take(self) -> tuple[float, float | None]:
        """Forward seconds and the last forward's end since the previous call."""
        seconds, end = self.seconds, self.last_end
        self.seconds, self.last_end = 0.0, None
        return seconds, end


class EngineLoop:
    """Builds and drives one engine from one thread; other threads only enqueue work.

    The engine is built in the engine thread (`start_engine`) so that every torch operator of the
    engine (start-up warm-up included) runs in that one thread: OpenMP keeps a thread team per
    thread that runs parallel operators, and once libgomp manages more threads than there are
    cores it stops spinning at its barriers and sleeps instead, which makes every multi-threaded
    operator pay for waking its team (measured: a 2-thread MLP layer 190-215 µs → 375-440 µs per
    call once a second thread had run parallel operators). vLLM's CPU thread binding
    (VLLM_CPU_OMP_THREADS_BIND) is applied by the worker in the thread that builds it, hence
    in the thread that runs it too.
    """

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        torch_threads: int | None | Callable[[LLMEngine], int | None] = None,
    ) -> None:
        self._build = build
        self._torch_threads = torch_threads
        self._engine: LLMEngine | None = None
        self._build_error: BaseException | None = None
        self._built = threading.Event()
        self._serving = threading.Event()
        self._sink: Callable[[EngineEvent], None] = lambda _event: None
        self._on_state: Callable[[KvCacheStats], None] | None = None
        self._clock: ForwardClock | None = None
        self._time_steps = False
        self._last_schedule: object = None
        self._window_step_tokens = 0  # tokens of each step after the first in the current window
        self._preemptions = 0  # the schedulers' preemptions so far
        self._state_interval = 0.25
        self._state_reported_at = 0.0
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._in_engine: set[str] = set()
        # best_of requests: request id → all candidate sequences (vLLM returns only the best n).
        self._candidates: dict[str, list] = {}
        # Requests from submission to admission (prepared off this thread when they need it); a
        # refused one fails through the sink of the moment.
        self._admissions = Admissions(
            lambda: self.engine,
            self._wake.set,
            lambda request_id, message: self._sink(RequestFailed(request_id, message)),
        )
        # Set once the engine thread has settled an idle engine (window closed, workers released).
        self.settled = threading.Event()
        self._settled = False
        self.error: str | None = None
        self.torch_threads: int | None = None  # what the engine thread runs with, once built
        self._thread = threading.Thread(target=self._main, name="vllm-engine-loop", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._serving.is_set() and self._thread.is_alive()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("the engine is not built")
        return self._engine

    @property
    def facts(self) -> EngineFacts:
        return engine_facts(self.engine)

    def shutdown(self) -> None:
        """Stop the loop and shut the engine's executor down (its workers)."""
        self.stop()
        if self._engine is not None:
            self._engine.model_executor.shutdown()

    def start_engine(self) -> LLMEngine:
        """Start the engine thread and wait until it has built the engine; raises what the build raised."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        return self.engine

    def serve(
        self,
        sink: Callable[[EngineEvent], None],
        on_state: Callable[[KvCacheStats], None] | None = None,
        state_interval: float = 0.25,
        time_steps: bool = False,
    ) -> None:
        """Hand the built engine's events to `sink` and start stepping it."""
        engine = self.engine
        self._sink = sink
        self._on_state = on_state
        self._state_interval = state_interval
        # Forward-pass timing (metrics' lag and host-overhead series) only where hooks measure it.
        model = driver_model(engine) if time_steps and module_hooks_time_the_forward_pass(engine) else None
        self._clock = ForwardClock(model) if model is not None else None
        self._time_steps = time_steps
        self._serving.set()

    def submit(self, request: EngineRequest) -> None:
        """Queue a request for the engine thread (any thread); vLLM's objects are built from its
        plain values here (engine/admission.py)."""
        self._admissions.submit(request)

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._serving.set()  # a thread still waiting to serve must see the stop
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def kv_cache_stats(self) -> KvCacheStats:
        """Read without locking: counters only, a moment's staleness is fine."""
        schedulers = self.engine.scheduler
        return KvCacheStats(
            free_blocks=sum(s.block_manager.get_num_free_gpu_blocks() for s in schedulers),
            total_blocks=(self.engine.cache_config.num_gpu_blocks or 0) * len(schedulers),
            running=sum(len(s.running) for s in schedulers),
            waiting=sum(len(s.waiting) + len(s.swapped) for s in schedulers),
            prefix_cache_hit_rate=prefix_cache_hit_rate(schedulers),
            running_lora_adapters=lora_adapter_names(s.running for s in schedulers),
            waiting_lora_adapters=lora_adapter_names(s.waiting for s in schedulers),
        )

    def _admit_and_abort(self) -> None:
        while self._aborts:
            request_id = self._aborts.popleft()
            self._admissions.abort(request_id)  # dropped before admission, wherever it is now
            if request_id in self._in_engine:
                self.engine.abort_request(request_id)
                self._in_engine.discard(request_id)
                self._candidates.pop(request_id, None)
        for item in self._admissions.take():
            try:
                if item.processed is not None:
                    # Processed on the image prompt thread: what vLLM's add_request does after its
                    # own preprocessing (checks of the processed prompt, the sequence group).
                    self.engine._add_processed_request(
                        request_id=item.request_id,
                        processed_inputs=item.processed,
                        params=item.params,
                        arrival_time=time.time(),
                        lora_request=item.lora_request,
                        prompt_adapter_request=None,
                        priority=item.priority,
                    )
                else:
                    self.engine.add_request(
                        item.request_id,
                        TokensPrompt(prompt_token_ids=item.prompt_token_ids),
                        item.params,
                        lora_request=item.lora_request,
                        priority=item.priority,
                    )
            except Exception as error:
                # One request the engine refuses (vLLM raises ValueError, TypeError, ...) must not
                # take the engine thread down with it; the engine is unchanged by a refused add.
                if not isinstance(error, ValueError):
                    logger.warning("engine refused request %s: %r", item.request_id, error)
                self._sink(RequestFailed(item.request_id, str(error) or type(error).__name__))
            else:
                self._in_engine.add(item.request_id)
                if isinstance(item.params, SamplingParams) and item.params.n > (item.params._real_n or item.params.n):
                    self._remember_candidates(item.request_id)

    def _remember_candidates(self, request_id: str) -> None:
        """Keep a best_of request's candidate sequences: its output holds only the best n of them."""
        group = self.engine.seq_id_to_seq_group.get(f"{request_id}_parallel_sample_0")
        assembled = getattr(group, "assembled_seq_group", None)
        if assembled is not None:
            self._candidates[request_id] = list(assembled.seqs)

    def _unreturned(self, output: RequestOutput) -> tuple[int, int] | None:
        """(tokens, sequences) of a finished best_of request's candidates that its output leaves out."""
        candidates = self._candidates.pop(output.request_id, None)
        if candidates is None:
            return None
        returned = sum(len(c.token_ids) for c in output.outputs)
        total = sum(seq.get_output_len() for seq in candidates)
        return max(0, total - returned), max(0, len(candidates) - len(output.outputs))

    def _report_state(self, force: bool = False) -> None:
        """Engine gauges at most every `state_interval` s while busy; once when going idle."""
        if self._on_state is None:
            return
        now = time.monotonic()
        if force and self._state_reported_at < 0:
            return  # already reported this idle period
        if force or now - self._state_reported_at >= self._state_interval:
            self._state_reported_at = -1.0 if force else now
            try:
                self._on_state(self.kv_cache_stats())
            except Exception:
                logger.exception("reporting engine state failed")

    def _main(self) -> None:
        try:
            self._engine = self._build()
            import torch

            # Applied last, so the count the engine runs with is ours whatever the build did to
            # torch's (vLLM's multiprocessing executor sets it to 1 when OMP_NUM_THREADS is unset;
            # on CPU, vLLM's platform sets OMP_NUM_THREADS from torch's count first).
            # A callable chooses from the built engine (e.g. by its model's size).
            threads = self._torch_threads(self._engine) if callable(self._torch_threads) else self._torch_threads
            if threads is not None:
                torch.set_num_threads(threads)
            self.torch_threads = torch.get_num_threads()
        except BaseException as error:
            self._build_error = error
            return
        finally:
            self._built.set()
        self._serving.wait()
        if not self._stopping:
            self._run(self.engine)

    def _run(self, engine: LLMEngine) -> None:
        try:
            while not self._stopping:
                self._admit_and_abort()
                if not engine.has_unfinished_requests():
                    if not self._settled:
                        self._settle(engine)
                    self._report_state(force=True)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                if self._settled:
                    self._settled = False
                    self.settled.clear()
                started = time.perf_counter()
                try:
                    outputs = engine.step()
                except InputProcessingError as error:
                    self._fail_unprocessable(error)
                    continue
                if self._admissions.constraint_failures:
                    outputs = self._fail_constraints(outputs)
                self._hand_over(outputs, time.perf_counter() - started)
                self._report_state()
            # Stopping (unload): release remote workers from their execution loop, or the
            # executor's shutdown cannot reach them.
            engine.model_executor.stop_remote_worker_execution_loop()
            self._admissions.stop()
        except BaseException as error:
            self.error = f"vLLM engine failed: {type(error).__name__}: {error}"
            logger.error("%s\n%s", self.error, traceback.format_exc())
            # In the engine, queued for admission or still being prepared: none will ever end now.
            lost = sorted(self._in_engine) + self._admissions.lost()
            self._sink(EngineDied(self.error, lost))

    def _hand_over(self, outputs: list[RequestOutput], seconds: float) -> None:
        unreturned: dict[str, tuple[int, int]] = {}
        if outputs:
            for output in outputs:
                if output.finished:
                    self._in_engine.discard(output.request_id)
                    if self._candidates and (hidden := self._unreturned(output)) is not None:
                        unreturned[output.request_id] = hidden
        if self._time_steps:
            self._sink(self._timed_step(outputs, seconds, unreturned))
        elif outputs:
            # Plain values (a new list: V0 reuses and clears the returned one on the next step).
            self._sink(StepOutputs(plain_outputs(outputs), seconds, unreturned=unreturned))

    def _settle(self, engine: LLMEngine) -> None:
        """Once per idle period: close the window the finished requests left, release the workers."""
        started = time.perf_counter()
        outputs = settle_idle_engine(engine)
        if outputs:
            self._hand_over(outputs, time.perf_counter() - started)
        self._settled = True
        self.settled.set()

    def _fail_constraints(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Requests whose constraint failed during the step (engine/constraints.ConstraintGuard):
        abort each, drop its output of the step (sampled without the constraint), fail it alone."""
        failures = self._admissions.constraint_failures
        failed = dict(failures)
        failures.clear()
        for request_id, message in failed.items():
            logger.warning("structured output of request %s failed: %s", request_id, message)
            if request_id in self._in_engine:
                self.engine.abort_request(request_id)
                self._in_engine.discard(request_id)
            self._sink(RequestFailed(request_id, message))
        return [output for output in outputs if output.request_id not in failed]

    def _fail_unprocessable(self, error: InputProcessingError) -> None:
        """vLLM could not prepare one request's input: fail that request alone and keep stepping.

        vLLM's LLMEngine.step has already aborted it and kept the rest of the schedule for the next
        step (`_abort_and_cache_schedule`) before re-raising, as MQLLMEngine expects too.
        """
        logger.warning("engine could not process request %s: %s", error.request_id, error.message)
        self._in_engine.discard(error.request_id)
        self._candidates.pop(error.request_id, None)
        self._sink(RequestFailed(error.request_id, f"the engine could not process this request: {error.message}"))

    def _timed_step(
        self, outputs: list[RequestOutput], seconds: float, unreturned: dict[str, tuple[int, int]]
    ) -> StepOutputs:
        forward_seconds, forward_end = self._clock.take() if self._clock is not None else (None, None)
        # The engine's scheduler context holds the latest round's SchedulerOutputs: a new
        # object that is not empty means this step started a scheduling window.
        scheduled = self.engine.scheduler_contexts[0].scheduler_outputs
        new_window = scheduled is not self._last_schedule and scheduled is not None and not scheduled.is_empty()
        self._last_schedule = scheduled
        iteration_tokens = None
        if new_window:
            iteration_tokens, self._window_step_tokens = window_tokens(scheduled)
        elif scheduled is not None and not scheduled.is_empty():
            iteration_tokens = self._window_step_tokens
        preemptions = sum(s.num_cumulative_preemption for s in self.engine.scheduler)
        preempted, self._preemptions = preemptions - self._preemptions, preemptions
        return StepOutputs(
            plain_outputs(outputs),
            seconds,
            forward_seconds=forward_seconds,
            forward_end=forward_end,
            new_window=new_window,
            unreturned=unreturned,
            iteration_tokens=iteration_tokens,
            preemptions=preempted,
        )


def serving_loop(
    engine_args: EngineArgs,
    stream_mode: StreamMode,
    user_threads: Mapping[str, str | None],
    adapters: Sequence[tuple[str, int, str]] = (),
) -> EngineLoop:
    """The EngineLoop a served model runs (in the stub or in an engine process): it builds the engine
    in its thread, warms it up there (a setting that would fail the first request fails the load),
    loads the model's LoRA `adapters` ((name, lora_int_id, path)) once (a bad one fails the load) and
    applies the serving thread policy unless the user chose (`user_threads`, read before the build
    by cpu_placement.thread_choice_of_user)."""
    return EngineLoop(
        lambda: preload_adapters(warmed_up(build_engine(engine_args, stream_mode=stream_mode), engine_args), adapters),
        lambda engine: serving_torch_threads(model_parameters(engine), user_threads),
    )
