"""The V1 engine process: vLLM's current engine under the V1 environment's Python, driven through
engine/process.py's messages (`python -m triton_vllm_multistep.engine_v1.process FD no-ipex CPUS`,
the arguments of engine/process.py's entry).

Owns building V1's LLMEngine from the model's engine arguments, and the engine thread: the only
caller of the engine, it admits requests (V1's SamplingParams from the plain fields: sampling.py),
aborts them, steps, and sends each step's outputs as StepOutputs (engine/outputs.py's conversion),
the KV cache's state as KvCacheStats, a refused request as RequestFailed and a failed step as
EngineDied. The main thread only reads the stub's messages and queues them for the engine thread.
Nothing of vLLM crosses: what is sent is engine/events.py's plain types.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.engine.events import (
    EMPTY_PROMPT_MESSAGE,
    EngineBuildError,
    EngineDied,
    EngineFacts,
    EngineRequest,
    RequestFailed,
    StepOutputs,
    load_adapters_once,
    prompt_limit,
    prompt_too_long_message,
    token_ids_of,
)
from triton_vllm_multistep.engine.messages import Abort, Built, EngineSpec, Serve, Stop, Stopped, build_failure, sender
from triton_vllm_multistep.engine.outputs import plain_outputs
from triton_vllm_multistep.engine_v1 import cpu_async, cpu_compile_cache, cpu_executor, cpu_lora, images, stats
from triton_vllm_multistep.engine_v1.completions import CompletionFold
from triton_vllm_multistep.engine_v1.sampling import pooling_params, sampling_params
from triton_vllm_multistep.interface import SERVED_TASKS

logger = logging.getLogger(__name__)
if os.environ.get(cpu_lora.FIX_ENV):  # in vLLM's engine core too: spawned, it imports this module again
    cpu_lora.exact_base_rows_in_mixed_batches()
if os.environ.get(cpu_async.KEEP_ENV):  # the same
    cpu_async.keep_async_scheduling()
# What the engine thread waits for a command when it has nothing to step.
IDLE_WAIT_SECONDS = 0.05
# How often the core watcher looks at whether vLLM has found its engine core dead.
CORE_WATCH_SECONDS = 0.2


class _CoreDied:
    """The core watcher's command: the engine core is gone (the engine thread raises vLLM's error)."""


def build_engine(spec: EngineSpec) -> tuple[Any, stats.SchedulerStatsLogger]:
    """V1's LLMEngine for the spec's engine arguments, its scheduler stats captured."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    # Stats on whatever model.json says: the scheduler's stats are the metrics' KV-cache figures
    # (KvCacheStats); config.pbtxt / model.json decide whether the stub publishes them.
    arguments = {**spec.engine_args, "disable_log_stats": False}
    try:
        engine_args = EngineArgs(**arguments)
    except (TypeError, ValueError) as error:  # model.json's fields, in vLLM's words
        raise EngineBuildError(f"vLLM {vllm.__version__} (V1) refuses model.json's engine arguments: {error}") from None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        refuse_image_models_on_cpu(engine_args)
        cpu_compile_cache.use_loadable_compile_cache()  # before the engine core starts: it inherits it
    if engine_args.async_scheduling and current_platform.is_cpu():
        os.environ[cpu_async.KEEP_ENV] = "1"  # before the engine core starts: it inherits the environment
        cpu_async.keep_async_scheduling()
    if engine_args.enable_lora and current_platform.is_cpu():
        os.environ[cpu_lora.FIX_ENV] = "1"  # before the engine core starts: it inherits the environment
        cpu_lora.exact_base_rows_in_mixed_batches()
    recorder = stats.SchedulerStatsLogger.factory()
    if current_platform.is_cpu() and cpu_executor.runs_worker_in_core(engine_args):
        engine_args.distributed_executor_backend = cpu_executor.WORKER_IN_CORE_EXECUTOR
        vllm_config = engine_args.create_engine_config()
        with cpu_executor.core_threads_placed(vllm_config):
            engine = LLMEngine.from_vllm_config(vllm_config, stat_loggers=[recorder])
    else:
        engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[recorder])
    preload_adapters(engine, spec.lora_adapters)
    return engine, recorder.latest


def refuse_image_models_on_cpu(engine_args: Any) -> None:
    """An image model on a CPU host is a load error saying so: the V1 environment has no torchvision
    (PyPI's builds need CUDA and break `import vllm` on CPU), without which vLLM 0.32 cannot even
    inspect such a model (its own error only says "failed to be inspected")."""
    from transformers import AutoConfig
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS

    try:
        config = AutoConfig.from_pretrained(engine_args.model, trust_remote_code=engine_args.trust_remote_code)
    except Exception:  # vLLM's own build says what is wrong with the model
        return
    image_models = sorted(set(getattr(config, "architectures", None) or ()) & set(_MULTIMODAL_MODELS))
    if image_models:
        raise EngineBuildError(
            f"{image_models[0]} is a multimodal model: on vllm_engine 'v1' this backend serves it on GPU hosts "
            "only (the V1 environment on CPU has no torchvision); on CPU serve it with vllm_engine 'multistep'"
        )


def preload_adapters(engine: Any, adapters: tuple[tuple[str, int, str], ...]) -> None:
    """multi_lora.json's adapters loaded once into V1's engine core, as a request would load them (its
    PEFT checks, rank, modules): a bad one fails the model's load naming it, as on the multi-step
    engine, the engine shut down; not at its first request."""
    from vllm.lora.request import LoRARequest

    load_adapters_once(
        adapters, lambda *adapter: engine.add_lora(LoRARequest(*adapter)), lambda: engine.engine_core.shutdown()
    )


def engine_facts(engine: Any) -> EngineFacts:
    model_config = engine.vllm_config.model_config
    lora_config = engine.vllm_config.lora_config
    return EngineFacts(
        model=str(model_config.model),
        # The stub checks input_ids and logit_bias against it; it has no tokenizer of a V1 model.
        vocab_size=token_ids_of(engine.get_tokenizer(), model_config.get_vocab_size()),
        max_model_len=model_config.max_model_len,
        multimodal=bool(model_config.is_multimodal_model),
        num_scheduler_steps=1,
        attention_kernels="vLLM V1",
        max_loras=lora_config.max_loras if lora_config else 0,
        images_per_prompt=images.images_per_prompt(model_config),
        async_scheduling=bool(engine.vllm_config.scheduler_config.async_scheduling),
        scheduling_policy=str(engine.vllm_config.scheduler_config.policy),
        cache_config=tuple(engine.vllm_config.cache_config.metrics_info().items()),
        tasks=tuple(task for task in SERVED_TASKS if task in engine.get_supported_tasks()),
    )


class EngineThread:
    """The engine's one caller: commands in through a queue, events out through `send`."""

    def __init__(
        self, engine: Any, send: Any, recorder: stats.SchedulerStatsLogger, max_prompt_tokens: int = 0
    ) -> None:
        self.engine = engine
        self.send = send
        self.recorder = recorder
        self.tokenizer = engine.get_tokenizer()
        self.prompt_limit = prompt_limit(engine.vllm_config.model_config.max_model_len, max_prompt_tokens)
        self.commands: queue.Queue[Any] = queue.Queue()
        self.serve: Serve | None = None
        self.in_flight: set[str] = set()
        self.fold = CompletionFold()
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-v1-engine", daemon=True)
        self._next_state = 0.0

    def start(self) -> None:
        self._thread.start()
        threading.Thread(target=self._watch_core, name="vllm-v1-core-watch", daemon=True).start()

    def _watch_core(self) -> None:
        """vLLM 0.32's synchronous client sees its engine core die (its monitor marks it dead and shuts
        the client down) but leaves a step waiting for outputs forever, and an idle engine would only
        fail its next request. Measured: a core killed mid-stream left the stream hanging. Wake the
        engine thread with vLLM's own EngineDeadError, whether it steps or idles."""
        client = self.engine.engine_core
        while not self.stopped.wait(CORE_WATCH_SECONDS):
            if getattr(getattr(client, "resources", None), "engine_dead", False):
                from vllm.v1.engine.exceptions import EngineDeadError

                self.commands.put(_CoreDied())
                outputs = getattr(client, "outputs_queue", None)
                if outputs is not None:
                    outputs.put_nowait(EngineDeadError())
                return

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                self._take_commands(block=not self.in_flight or self.serve is None)
                if self.serve is not None and self.in_flight and not self.stopped.is_set():
                    self._step()
                self._report_state()
        except BaseException as error:  # the engine failed: every request in it is lost
            logger.exception("vLLM V1 engine failed")
            self.send(EngineDied(f"vLLM engine failed: {type(error).__name__}: {error}", sorted(self.in_flight)))
            self.in_flight.clear()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=IDLE_WAIT_SECONDS) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Any) -> None:
        if isinstance(command, EngineRequest):
            self._admit(command)
        elif isinstance(command, Abort):
            if command.request_id in self.in_flight:
                self.in_flight.discard(command.request_id)
                self.fold.forget(command.request_id)
                self.engine.abort_request([command.request_id])
        elif isinstance(command, Serve):
            self.serve = command
        elif isinstance(command, Stop):
            self.stopped.set()
        elif isinstance(command, _CoreDied):
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()

    def _admit(self, request: EngineRequest) -> None:
        if request.pooling is None:
            try:
                params = sampling_params(request.sampling)
            except Exception as error:  # V1's own checks of the fields (its VLLMValidationError is no ValueError)
                self.send(RequestFailed(request.request_id, f"{request.sampling_source}: {error}"))
                return
        try:
            if request.pooling is not None:
                params = pooling_params(request.pooling)
            lora = None
            if request.adapter is not None:
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(*request.adapter)
            prompt = images.with_images(self._prompt(request), request.images)
            self.engine.add_request(request.request_id, prompt, params, lora_request=lora, priority=request.priority)
        except Exception as error:  # this request alone: refused in vLLM's words (or the stub's)
            self.send(RequestFailed(request.request_id, str(error)))
            return
        self.in_flight.add(request.request_id)
        if request.pooling is None:
            self.fold.add(request.request_id, request.sampling)

    def _prompt(self, request: EngineRequest) -> dict[str, Any]:
        """The prompt as V1 takes it: a text prompt tokenized here, as V1's own input processing does
        (the tokenizer's `encode`, special tokens added), and checked as the stub checks token ids."""
        if request.prompt_text is None:
            return {"prompt_token_ids": list(request.prompt_token_ids)}
        ids = self.tokenizer.encode(request.prompt_text)
        if not ids:
            raise ValueError(EMPTY_PROMPT_MESSAGE)
        if len(ids) > self.prompt_limit:
            raise ValueError(prompt_too_long_message(len(ids), self.prompt_limit))
        return {"prompt_token_ids": ids, "prompt": request.prompt_text}

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.fold.fold(plain_outputs(self.engine.step()))
        for output in outputs:
            if output.finished:
                self.in_flight.discard(output.request_id)
        serve = self.serve
        iteration_tokens, preemptions = self.recorder.take_iteration()
        if outputs or (serve is not None and serve.time_steps):
            self.send(
                StepOutputs(
                    outputs,
                    time.perf_counter() - started,
                    forward_seconds=None,
                    iteration_tokens=iteration_tokens,
                    preemptions=preemptions,
                )
            )

    def _report_state(self) -> None:
        serve = self.serve
        if serve is None or not serve.report_state or time.monotonic() < self._next_state:
            return
        self._next_state = time.monotonic() + serve.state_interval
        total = self.engine.vllm_config.cache_config.num_gpu_blocks or 0
        idle = not self.in_flight and not self.engine.has_unfinished_requests()
        self.send(self.recorder.kv_cache_stats(total, running_fallback=len(self.in_flight), idle=idle))


def serve_engine(connection: Connection) -> None:
    """The engine process: build, then follow the stub's commands until Stop or the stub is gone."""
    send = sender(connection)
    try:
        spec = connection.recv()
    except (EOFError, OSError):
        return
    if not isinstance(spec, EngineSpec):
        return
    try:
        engine, recorder = build_engine(spec)
        facts = engine_facts(engine)
    except BaseException as error:
        connection.send(build_failure(error))
        return
    import torch

    send(Built(facts, torch.get_num_threads()))
    runner = EngineThread(engine, send, recorder, spec.max_prompt_tokens)
    runner.start()
    try:
        while not runner.stopped.is_set():
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break
            runner.commands.put(message)
            if isinstance(message, Stop):
                break
    finally:
        runner.commands.put(Stop())
        runner.join(30)
        try:
            engine.engine_core.shutdown()
        except Exception:
            logger.exception("shutting the V1 engine core down failed")
        try:
            send(Stopped())
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    from triton_vllm_multistep.engine_v1 import process
    from triton_vllm_multistep.logs import log_package_to_stderr

    log_package_to_stderr()
    if sys.argv[3] != cpu_placement.ALL_CPUS:
        cpu_placement.pin_process(cpu_placement.parse_cpu_list(sys.argv[3]))
    process.serve_engine(Connection(int(sys.argv[1])))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
