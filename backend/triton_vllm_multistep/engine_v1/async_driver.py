"""The V1 engine driven by vLLM's asynchronous client (AsyncLLM), as `vllm serve` drives it.

Owns an alternative to process.py's EngineThread, chosen with TRITON_VLLM_MULTISTEP_V1_DRIVER=async
(measured against it in docs/performance.md before it may become the default): requests are added on
an asyncio loop as they arrive, while vLLM's output handler takes each step's outputs from the engine
core, instead of one by one between steps on the thread that also waits for the step. Each request's
per-step output is taken as vLLM's output processor hands it out (the request's collector's `put`),
never merged with the next step's, and a step's outputs go to the stub as one StepOutputs when vLLM
records that step's statistics (once per step, after all its outputs); a writer thread does the pipe
sends. Same messages in and out as EngineThread; nothing of vLLM crosses.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from triton_vllm_multistep.engine.events import EngineDied, EngineRequest, RequestFailed, StepOutputs
from triton_vllm_multistep.engine.messages import Abort, Serve, Stop
from triton_vllm_multistep.engine.outputs import plain_outputs
from triton_vllm_multistep.engine_v1 import stats

logger = logging.getLogger(__name__)

# A request → (prompt, params, LoRARequest or None), raising for a refused one (process.RequestPreparation).
Preparation = Callable[[EngineRequest], tuple[Any, Any, Any]]
DRIVER_ENV = "TRITON_VLLM_MULTISTEP_V1_DRIVER"
ASYNC_DRIVER = "async"
# How often the state reporter looks at the engine (its KV cache, whether vLLM found its core dead).
WATCH_SECONDS = 0.05


class AsyncEngineDriver:
    """AsyncLLM on an asyncio loop of its own thread; `put` takes the stub's messages from any thread."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send
        self._prepare: Preparation | None = None  # set by attach
        self.loop = asyncio.new_event_loop()
        self.engine: Any = None
        self.recorder: stats.SchedulerStatsLogger | None = None
        self.serve: Serve | None = None
        self.in_flight: set[str] = set()
        self.stopped = threading.Event()
        self._pending: list[Any] = []  # this step's vLLM outputs, in the order vLLM handed them out
        self._last_flush = time.perf_counter()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._failed = False
        threading.Thread(target=self.loop.run_forever, name="vllm-v1-async", daemon=True).start()
        self._writer = threading.Thread(target=self._write, name="vllm-v1-sender", daemon=True)
        self._writer.start()

    def call(self, coroutine: Any) -> Any:
        """Run `coroutine` on the engine's loop and wait for its result (the build, adapters, facts)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def attach(
        self,
        engine: Any,
        recorder: stats.SchedulerStatsLogger,
        prepare: Callable[[EngineRequest], tuple[Any, Any, Any]],
    ) -> None:
        """The built AsyncLLM: its step statistics end each step (the flush, on the loop: vLLM records
        them in its output handler), its output processor hands each output here."""
        self.engine, self.recorder, self._prepare = engine, recorder, prepare
        recorder.on_record = self._flush
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._watch()))

    # Messages from the stub (main thread).
    def put(self, message: Any) -> None:
        self.loop.call_soon_threadsafe(self._apply, message)

    def _apply(self, message: Any) -> None:
        if isinstance(message, EngineRequest):
            self._admit(message)
        elif isinstance(message, Abort):
            if message.request_id in self.in_flight:
                self.in_flight.discard(message.request_id)
                self.loop.create_task(self.engine.abort(message.request_id))
        elif isinstance(message, Serve):
            self.serve = message
        elif isinstance(message, Stop):
            self.stopped.set()

    def _admit(self, request: EngineRequest) -> None:
        assert self._prepare is not None
        try:
            prompt, params, lora = self._prepare(request)
        except Exception as error:  # this request alone: refused in vLLM's words (or the stub's)
            self._outbox.put(RequestFailed(request.request_id, str(error)))
            return
        self.in_flight.add(request.request_id)
        self.loop.create_task(self._add(request, prompt, params, lora))

    async def _add(self, request: EngineRequest, prompt: Any, params: Any, lora: Any) -> None:
        try:
            collector = await self.engine.add_request(
                request.request_id, prompt, params, lora_request=lora, priority=request.priority
            )
        except Exception as error:
            self.in_flight.discard(request.request_id)
            if getattr(self.engine, "errored", False):
                self._engine_died(error)
            else:
                self._outbox.put(RequestFailed(request.request_id, str(error)))
            return
        early = collector.output  # an output handed out before this line (the loop was busy)
        collector.put = self._take  # every later output comes here, one per step
        collector.output = None
        if early is not None:
            self._take(early)

    def _take(self, output: Any) -> None:
        """vLLM's output processor's hand-out of one request's output (or the engine's failure)."""
        if isinstance(output, BaseException):
            self._engine_died(output)
            return
        self._pending.append(output)

    def _flush(self) -> None:
        """The step's outputs as one StepOutputs (called once per step, after vLLM recorded it)."""
        assert self.recorder is not None
        outputs, self._pending = self._pending, []
        now = time.perf_counter()
        elapsed, self._last_flush = now - self._last_flush, now
        iteration_tokens, preemptions = self.recorder.take_iteration()
        serve = self.serve
        if not outputs and not (serve is not None and serve.time_steps):
            return
        plain = plain_outputs(outputs)
        for output in plain:
            if output.finished:
                self.in_flight.discard(output.request_id)
        self._outbox.put(StepOutputs(plain, elapsed, None, iteration_tokens, preemptions))

    def _engine_died(self, error: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        logger.error("vLLM V1 engine failed: %s: %s", type(error).__name__, error)
        self._outbox.put(EngineDied(f"vLLM engine failed: {type(error).__name__}: {error}", sorted(self.in_flight)))
        self.in_flight.clear()

    async def _watch(self) -> None:
        """The KV cache's state at the stub's interval, and vLLM's finding that its core is dead (an idle
        engine would only fail its next request)."""
        next_state = 0.0
        while not self.stopped.is_set():
            await asyncio.sleep(WATCH_SECONDS)
            if getattr(self.engine, "errored", False):
                self._engine_died(self.engine.dead_error)
                return
            serve = self.serve
            if serve is None or not serve.report_state or time.monotonic() < next_state:
                continue
            next_state = time.monotonic() + serve.state_interval
            assert self.recorder is not None
            total = self.engine.vllm_config.cache_config.num_gpu_blocks or 0
            idle = not self.in_flight and not self.engine.output_processor.has_unfinished_requests()
            self._outbox.put(self.recorder.kv_cache_stats(total, running_fallback=len(self.in_flight), idle=idle))

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._send(message)
            except (OSError, ValueError):  # the stub is gone
                return

    def stop(self, last: Any = None) -> None:
        """Shut the engine down, end the loop, and the writer once it has sent what it holds (and
        `last`, the stub's Stopped)."""
        self.stopped.set()
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting the V1 engine down failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        if last is not None:
            self._outbox.put(last)
        self._outbox.put(None)
        self._writer.join(10)
