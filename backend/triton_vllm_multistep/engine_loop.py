"""The engine thread: the only code that touches the `LLMEngine` after it is built.

Owns admitting and aborting requests between steps and calling `step()`; must not build
or send Triton responses (it hands `RequestOutput`s to a sink and returns to the engine).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutputs:
    """The outputs one `step()` returned (one pythonized decode step, or one window)."""

    outputs: list[RequestOutput]
    step_seconds: float
    finished_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RequestFailed:
    """The engine refused or lost one request."""

    request_id: str
    message: str


@dataclass(frozen=True)
class EngineDied:
    """The engine raised from `step()`; every request in it is lost."""

    message: str
    request_ids: list[str]


@dataclass(frozen=True)
class KvCacheStats:
    """Block counts of the engine's KV cache (device blocks; CPU memory on CPU)."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting: int


EngineEvent = StepOutputs | RequestFailed | EngineDied


@dataclass(frozen=True)
class _Admission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class EngineLoop:
    """Drives one engine from one thread; other threads only enqueue work."""

    def __init__(
        self,
        engine: LLMEngine,
        sink: Callable[[EngineEvent], None],
        on_state: Callable[[KvCacheStats], None] | None = None,
        state_interval: float = 0.25,
    ) -> None:
        self._engine = engine
        self._sink = sink
        self._on_state = on_state
        self._state_interval = state_interval
        self._state_reported_at = 0.0
        self._admissions: deque[_Admission] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._in_engine: set[str] = set()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._admissions.append(_Admission(request_id, prompt_token_ids, params))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def kv_cache_stats(self) -> KvCacheStats:
        """Read without locking: counters only, a moment's staleness is fine."""
        schedulers = self._engine.scheduler
        return KvCacheStats(
            free_blocks=sum(s.block_manager.get_num_free_gpu_blocks() for s in schedulers),
            total_blocks=(self._engine.cache_config.num_gpu_blocks or 0) * len(schedulers),
            running=sum(len(s.running) for s in schedulers),
            waiting=sum(len(s.waiting) + len(s.swapped) for s in schedulers),
        )

    def _admit_and_abort(self) -> None:
        while self._aborts:
            request_id = self._aborts.popleft()
            if request_id in self._in_engine:
                self._engine.abort_request(request_id)
                self._in_engine.discard(request_id)
        while self._admissions:
            item = self._admissions.popleft()
            try:
                self._engine.add_request(
                    item.request_id, TokensPrompt(prompt_token_ids=item.prompt_token_ids), item.params
                )
            except ValueError as error:
                self._sink(RequestFailed(item.request_id, str(error)))
            else:
                self._in_engine.add(item.request_id)

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

    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stopping:
                self._admit_and_abort()
                if not engine.has_unfinished_requests():
                    self._report_state(force=True)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                outputs = engine.step()
                if outputs:
                    for output in outputs:
                        if output.finished:
                            self._in_engine.discard(output.request_id)
                    # V0 reuses and clears the returned list on the next step: hand over a copy.
                    self._sink(StepOutputs(list(outputs), time.perf_counter() - started))
                self._report_state()
        except BaseException as error:
            self.error = f"vLLM engine failed: {type(error).__name__}: {error}"
            logger.error("%s\n%s", self.error, traceback.format_exc())
            lost = sorted(self._in_engine) + [a.request_id for a in self._admissions]
            self._admissions.clear()
            self._sink(EngineDied(self.error, lost))
