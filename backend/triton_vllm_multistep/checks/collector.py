"""The one engine-event collector: an engine runner's sink, read back per request.

Owns turning an EngineLoop's or EngineProcess's events (StepOutputs, RequestFailed, EngineDied) into
per-request Streams, with the engine's execute_model calls counted when the engine is in this
process; the GPU smoke check and the engine tests use it. Two ways to read: `collect` /
`outputs_of` take events in order from a queue into the Streams a caller names (the smoke check,
which reuses request ids), and every event is also kept (`seen`) and assembled as it arrives into
`streams` by request id, with `done` set once `expected` requests ended or the engine died (the
engine tests). Must not submit requests.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from triton_vllm_multistep.checks.report import Stream

WAIT_SECONDS = 120.0  # per wait for an engine event; a healthy engine answers in well under a second


class EventCollector:
    """The loop's sink: every event, with how many execute_model calls the engine had made by then
    (counted for an engine in this process; None: an engine process's events, not counted)."""

    def __init__(self, engine: Any = None, expected: int | None = None) -> None:
        self.events: queue.Queue[tuple[Any, int]] = queue.Queue()
        self.execute_calls = 0
        self.step_events = 0  # StepOutputs events read by collect()
        self.seen: list[Any] = []  # every event, in the order the runner handed them over
        self.states: list[Any] = []  # KvCacheStats, for a runner given `on_state=collector.states.append`
        self.streams: dict[str, Stream] = {}  # each request's stream as its events arrive (ids used once)
        self.done = threading.Event()  # `expected` requests ended (finished or failed), or the engine died
        self._expected = expected
        self._ended: set[str] = set()
        if engine is None:
            return
        execute_model = engine.model_executor.execute_model

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.execute_calls += 1
            return execute_model(*args, **kwargs)

        engine.model_executor.execute_model = counted

    def sink(self, event: Any) -> None:
        self.seen.append(event)
        self._assemble(event)
        self.events.put((event, self.execute_calls))

    def _assemble(self, event: Any) -> None:
        from triton_vllm_multistep.engine.events import EngineDied, RequestFailed, StepOutputs

        if isinstance(event, StepOutputs):
            for output in event.outputs:
                stream = self.streams.setdefault(output.request_id, Stream())
                completion = output.outputs[0]
                stream.deltas.append(list(completion.token_ids))
                stream.text += completion.text
                if stream.prompt_tokens is None and output.prompt_tokens is not None:  # a request's first output
                    stream.prompt_tokens = output.prompt_tokens
                if output.finished:
                    stream.finished, stream.finish_reason = True, completion.finish_reason
                    self._end(output.request_id)
        elif isinstance(event, RequestFailed):
            self.streams.setdefault(event.request_id, Stream()).failure = event.message
            self._end(event.request_id)
        elif isinstance(event, EngineDied):
            self.done.set()

    def _end(self, request_id: str) -> None:
        self._ended.add(request_id)
        if self._expected is not None and len(self._ended) >= self._expected:
            self.done.set()

    # Views of `streams`, as the engine tests compare them.
    @property
    def tokens(self) -> dict[str, list[int]]:
        """Request id → every token it streamed (requests that streamed any)."""
        return {request_id: stream.tokens for request_id, stream in self.streams.items() if stream.deltas}

    @property
    def texts(self) -> dict[str, str]:
        return {request_id: stream.text for request_id, stream in self.streams.items() if stream.deltas}

    @property
    def failed(self) -> dict[str, str]:
        """Request id → the engine's message, for each request it failed."""
        return {request_id: s.failure for request_id, s in self.streams.items() if s.failure is not None}

    @property
    def finish_reasons(self) -> dict[str, str | None]:
        return {request_id: s.finish_reason for request_id, s in self.streams.items() if s.finished}

    @property
    def prompt_tokens(self) -> dict[str, int]:
        return {request_id: s.prompt_tokens for request_id, s in self.streams.items() if s.prompt_tokens is not None}

    @property
    def steps_per_output(self) -> set[int]:
        """The token counts of every output of every request (one per decoded step: {1})."""
        return {len(delta) for stream in self.streams.values() for delta in stream.deltas}

    def finished(self) -> set[str]:
        return {request_id for request_id, stream in self.streams.items() if stream.finished}

    def deltas(self) -> dict[str, list[list[int]]]:
        return {request_id: stream.deltas for request_id, stream in self.streams.items() if stream.deltas}

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
