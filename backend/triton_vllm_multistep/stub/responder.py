"""The response thread: turns engine events into Triton responses and sends them.

Owns per-request response state, cancellation checks and the one-FINAL-per-request rule;
must not call the engine except through the abort callback.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from triton_vllm_multistep.engine.deltas import merge_deltas
from triton_vllm_multistep.engine.events import EngineDied, EngineEvent, EngineOutput, RequestFailed, StepOutputs
from triton_vllm_multistep.lifecycle.protocol import ENSEMBLE_CATCH_UP_SECONDS
from triton_vllm_multistep.output_tap import tap_failed_message
from triton_vllm_multistep.stub import codec, tap_writer, triton_io
from triton_vllm_multistep.stub.stream_merge import AdaptiveInterval

logger = logging.getLogger(__name__)
CANCEL_SWEEP_SECONDS = 0.05
# `is_cancelled()` is a blocking round trip to the tritonserver process (hundreds of µs under
# load, more than sending a response), so it is never asked per response: each request in flight
# is asked at most every CANCEL_CHECK_SECONDS, by the sweep, and a sweep asks at most
# CANCEL_CHECKS_PER_SWEEP of them (longest unchecked first).
CANCEL_CHECK_SECONDS = 0.1
CANCEL_CHECKS_PER_SWEEP = 4
_NOTHING = object()  # queue wait timed out: time to sweep for cancellations
# The most engine steps (StepOutputs events, each one step's outputs for every running request)
# queued for the response thread; when it is this far behind, the engine thread waits
# (backpressure) instead of running ahead. Two scheduling windows of the shipped
# num_scheduler_steps=8: the engine can finish its window and the next while the response thread
# rides out a stall (a GC pause, slow Triton IPC; 16 GPU steps of 2-10 ms = 30-160 ms), and a
# response path that is slower than the engine for good adds at most 16 of its steps to each
# response's latency, and holds at most 16 steps of outputs in memory, instead of without limit.
MAX_QUEUED_STEPS = 16
# Log the engine's waiting at most this often, once it adds up to BACKPRESSURE_LOG_MIN_WAIT s
# (short waits are the bound doing its job; a response path behind for good is worth a line).
BACKPRESSURE_LOG_SECONDS = 60.0
BACKPRESSURE_LOG_MIN_WAIT = 1.0


class EventQueue:
    """FIFO from the engine thread (and control calls) to the response thread.

    Engine steps are bounded (`max_steps`): `put_step` waits for room. Everything else (request
    failures, engine death, end-all, stop) is never refused and never waits, so stopping cannot
    wait on a full queue. Order is kept across both: a request's FINAL stays after its earlier
    outputs. Once closed (the response thread is gone), puts return at once and drop the item:
    nobody is left to send it, and every request has had its FINAL or never will.
    """

    def __init__(self, max_steps: int = MAX_QUEUED_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps = max_steps
        self._items: deque[object] = deque()
        self._steps = 0
        self._closed = False
        self._ready = threading.Condition(threading.Lock())
        self.waiting = 0  # put_step calls waiting for room now
        self.waited_seconds = 0.0  # total time put_step waited for room
        self._logged_at = -BACKPRESSURE_LOG_SECONDS
        self._logged_wait = 0.0

    def put_step(self, event: StepOutputs) -> bool:
        """Queue one step, waiting while `max_steps` are queued; False if closed (dropped)."""
        with self._ready:
            if self._steps >= self.max_steps and not self._closed:
                started = time.monotonic()
                self.waiting += 1
                while self._steps >= self.max_steps and not self._closed:
                    self._ready.wait()
                self.waiting -= 1
                self._note_wait(started)
            if self._closed:
                return False
            self._steps += 1
            self._items.append(event)
            self._ready.notify_all()
            return True

    def put(self, item: object) -> bool:
        """Queue anything but a step, without waiting; False if closed (dropped)."""
        with self._ready:
            if self._closed:
                return False
            self._items.append(item)
            self._ready.notify_all()
            return True

    def get(self, timeout: float) -> object:
        """The oldest item, _NOTHING after `timeout` seconds without one, None once closed (stop)."""
        with self._ready:
            if not self._items and not self._closed:
                self._ready.wait(timeout)
            if self._closed:
                return None
            if not self._items:
                return _NOTHING
            item = self._items.popleft()
            if isinstance(item, StepOutputs):
                self._steps -= 1
                self._ready.notify_all()
            return item

    def close(self) -> None:
        """No more items: release every waiting put and refuse later ones."""
        with self._ready:
            self._closed = True
            self._items.clear()
            self._steps = 0
            self._ready.notify_all()

    def queued_steps(self) -> int:
        return self._steps

    def _note_wait(self, started: float) -> None:
        now = time.monotonic()
        self.waited_seconds += now - started
        unlogged = self.waited_seconds - self._logged_wait
        if now - self._logged_at >= BACKPRESSURE_LOG_SECONDS and unlogged >= BACKPRESSURE_LOG_MIN_WAIT:
            logger.warning(
                "responses fall behind the engine: %d steps queued, the engine thread waited %.2f s for the "
                "response thread since the last report (backpressure; no output is dropped)",
                self.max_steps,
                unlogged,
            )
            self._logged_at, self._logged_wait = now, self.waited_seconds


@dataclass(frozen=True)
class EndRequests:
    """End every request in flight with an UNAVAILABLE FINAL (and abort it in the engine)."""

    message: str


@dataclass(frozen=True)
class Refusal:
    """An error FINAL for a request that never got into the engine (refused or invalid)."""

    sender: Any
    message: str
    code: Any


@dataclass(frozen=True)
class EndRequest:
    """End one registered request with an error FINAL (unless it has ended already)."""

    request_id: str
    message: str
    code: Any


@dataclass
class RequestState:
    """What the responder knows of one request in flight."""

    sender: Any  # pb_utils InferenceResponseSender
    request: codec.GenerationRequest | codec.EmbeddingRequest
    first: bool = True
    last_cancel_check: float = 0.0
    timing: Any = None  # metrics.RequestTiming when metrics are on
    # Streamed outputs not sent yet (stream_interval, or merged while the responses fall behind):
    # one delta output standing for `held_outputs` engine outputs.
    held: EngineOutput | None = None
    held_outputs: int = 0
    # The output tap connection its responses take (tap_writer.py), decided at its first response;
    # None: Triton's.
    tap_connection: int | None = None


@dataclass(frozen=True)
class TappedResponse:
    """A data response for the request's output tap: its output values, plain."""

    values: dict[str, list[Any]]


class Responder:
    """Consumes engine events on its own thread; every registered request gets one FINAL."""

    def __init__(
        self,
        pb_utils: Any,
        abort: Callable[[str], None],
        observer: Any = None,
        max_queued_steps: int = MAX_QUEUED_STEPS,
        stream_interval: int = 1,
        merge_when_behind: bool = False,
        caller: triton_io.TritonCaller | None = None,
    ) -> None:
        self._pb = pb_utils
        # Only this responder's thread calls into Triton while it runs (triton_io.TritonCaller).
        self.caller = caller or triton_io.TritonCaller()
        # Engine outputs per streamed response unless the request sets its own. With
        # `merge_when_behind` ("merge" stream mode) the interval also follows what responses cost
        # (AdaptiveInterval), and a stream's outputs are held while more engine steps are queued.
        self._stream_interval = stream_interval
        self._merge_when_behind = merge_when_behind
        self._adaptive = AdaptiveInterval(max_interval=max_queued_steps) if merge_when_behind else None
        self._merged_interval = 1  # the merge mode's steps per response for the step being handled
        self._holding: set[str] = set()  # requests with held outputs
        self._abort = abort
        self._observer = observer
        # Decodes detokenization windows (ensembles); a tokenizer of this thread's own.
        self.window_decode: Callable[[Sequence[int], int], str] | None = None
        self._states: dict[str, RequestState] = {}
        self.intake_closed: str | None = None  # why new requests are refused, once they are
        self._lock = threading.Lock()
        self._events = EventQueue(max_queued_steps)
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._taps = tap_writer.TapWriters()  # this thread's connections to OpenAI servers' output taps
        # Called on this thread once the errors of an engine failure are sent (not on stop()).
        self.after_engine_death: Callable[[str], None] | None = None
        # Called on this thread every turn of its loop (stub/heartbeat.py: sets its gauge when due).
        self.heartbeat: Callable[[float], None] | None = None
        self._stopping = False
        self._quiet = False  # quiesce(): the model's unload is asked
        self._thread = threading.Thread(target=self._run, name="triton-responder", daemon=True)

    def start(self) -> None:
        self.caller.hand_to(self._thread)
        self._thread.start()

    def stop(self, reason: str, timeout: float = 10.0) -> None:
        """Fail whatever is still in flight (server shutting down), then end the thread.

        Never waits on a full queue; an engine thread still waiting to post is released when the
        response thread ends (or here, if it does not end in time).
        """
        self._stopping = True
        self._events.put(EngineDied(reason, []))
        self._events.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._events.close()
        if not self._thread.is_alive():
            self.caller.hand_to(threading.current_thread())  # it has ended: the calls are ours again
        else:
            logger.error("the response thread did not end within %.0f s: its calls into Triton stay its own", timeout)

    def post(self, event: EngineEvent) -> None:
        """Called from the engine thread: a queue put; waits while MAX_QUEUED_STEPS steps are queued."""
        if isinstance(event, StepOutputs):
            self._events.put_step(event)
        else:
            self._events.put(event)

    def queued_steps(self) -> int:
        """Engine steps waiting for the response thread (cheap: a counter read)."""
        return self._events.queued_steps()

    def end_all(self, message: str) -> None:
        """Any thread: have the response thread end every request in flight.

        Only the response thread sends on a registered request's sender: a FINAL sent from another
        thread while it sends that request's next response crashes tritonserver 2.51 (seen: SIGSEGV
        in the Python backend when the second send reaches a response factory the FINAL freed).
        """
        self._events.put(EndRequests(message))

    def quiesce(self) -> None:
        """Response thread: from now on make no optional call into Triton (heartbeat, metrics flushes,
        cancellation checks); events are still answered. Called once the model's unload is asked."""
        self.caller.check("quiescing")
        self._quiet = True

    def register(self, request_id: str, state: RequestState) -> bool:
        """Take a request in; False (not taken) once intake is closed."""
        with self._lock:
            if self.intake_closed is not None:
                return False
            self._states[request_id] = state
        return True

    def close_intake(self, reason: str) -> None:
        """Refuse every later `register` (draining): atomic with it, so no request slips in after the count."""
        with self._lock:
            self.intake_closed = reason

    def in_flight(self) -> int:
        return len(self._states)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._states)

    def error_response(self, message: str, code: Any) -> Any:
        return triton_io.error_response(self._pb, message, code)

    def refuse(self, sender: Any, message: str, code: Any) -> None:
        """Any thread: have the response thread send one error FINAL to a request that never got into
        the engine (execute() refuses requests this way: it makes no call into Triton itself)."""
        self._events.put(Refusal(sender, message, code))

    def end(self, request_id: str, message: str, code: Any) -> None:
        """Any thread: have the response thread end a registered request with an error FINAL."""
        self._events.put(EndRequest(request_id, message, code))

    def send_error(self, sender: Any, message: str, code: Any) -> None:
        """Response thread: one error response flagged FINAL."""
        self.caller.check("sending an error response")
        try:
            sender.send(self.error_response(message, code), flags=self._final)
        except Exception:
            logger.warning("could not send error response: %s", message)

    def _with_image_count(self, request_id: str, message: str) -> str:
        """An engine's refusal of a request with images says how many it had."""
        with self._lock:
            state = self._states.get(request_id)
        if state is None or not state.request.images:
            return message
        count = len(state.request.images)
        logger.info("request %s with %d image(s) failed: %s", request_id, count, message)
        return f"{message} (the request has {count} image{'s' if count > 1 else ''})"

    def fail(self, request_id: str, message: str, code: Any) -> None:
        """Response thread: end a registered request with an error FINAL, unless it has already ended."""
        with self._lock:
            state = self._states.pop(request_id, None)
        if state is not None:
            self._error_final(request_id, state, message, code)

    def _error_final(self, request_id: str, state: RequestState, message: str, code: Any) -> None:
        """Response thread: the error FINAL of a request no longer registered."""
        self._holding.discard(request_id)  # its held outputs are dropped with it
        self.send_error(state.sender, message, code)

    def _run(self) -> None:
        try:
            self._serve_events()
        finally:
            self._events.close()  # however this thread ends, the engine thread must not wait on it
            self._taps.close()

    def _serve_events(self) -> None:
        last_sweep = time.monotonic()
        while True:
            event = self._events.get(timeout=CANCEL_SWEEP_SECONDS)
            if event is None:
                return
            if event is not _NOTHING:
                try:
                    self._handle(event)
                except Exception:
                    logger.exception("responder failed on %s", type(event).__name__)
            now = time.monotonic()
            if self._quiet:
                continue
            if self.heartbeat is not None:
                try:
                    self.heartbeat(now)
                except Exception:
                    logger.exception("setting the heartbeat failed")
            if self._observer is not None:
                try:
                    self._observer.maybe_flush(now)
                except Exception:
                    logger.exception("flushing metrics failed")
            if now - last_sweep >= CANCEL_SWEEP_SECONDS:
                last_sweep = now
                try:
                    self._sweep_cancelled()
                except Exception:  # an IPC error must not end the thread that sends every response
                    logger.exception("checking for cancelled requests failed")

    def _handle(self, event: EngineEvent | EndRequests | EndRequest | Refusal) -> None:
        if isinstance(event, StepOutputs):
            self._send_outputs(event)
        elif isinstance(event, RequestFailed):
            self.fail(
                event.request_id,
                self._with_image_count(event.request_id, event.message),
                self._pb.TritonError.INVALID_ARG,
            )
        elif isinstance(event, EndRequest):
            self.fail(event.request_id, event.message, event.code)
        elif isinstance(event, Refusal):
            self.send_error(event.sender, event.message, event.code)
        elif isinstance(event, EngineDied | EndRequests):
            if isinstance(event, EngineDied) and not self._stopping and self._observer is not None:
                self._observer.on_engine_died()  # the failure is counted before the requests hear of it
            request_ids = self.request_ids()
            self._send_held(request_ids)  # tokens already generated go out before the error
            if isinstance(event, EndRequests):
                for request_id in request_ids:
                    self._abort(request_id)  # the engine still runs it (a dead one runs nothing)
                # An ensemble that gets the LLM's error while it still postprocesses an earlier
                # response of the same request never finishes in Triton 2.51 (seen: one ensemble
                # request left in flight after a drain, holding the server's stop until its exit
                # timeout): stop the data first, let the ensembles catch up, then send the errors.
                time.sleep(ENSEMBLE_CATCH_UP_SECONDS)
            for request_id in request_ids:
                self.fail(request_id, event.message, self._pb.TritonError.UNAVAILABLE)
            if isinstance(event, EngineDied) and not self._stopping and self.after_engine_death is not None:
                self.after_engine_death(event.message)

    def _send_outputs(self, event: StepOutputs) -> None:
        if self._adaptive is not None:
            self._merged_interval = self._adaptive.interval(len(event.outputs))
        due: list[tuple[str, EngineOutput, RequestState]] = []
        for output in event.outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted or cancelled: its FINAL is already sent
            if state.request.stream:
                output = self._hold_or_release(output, state)
                if output is None:
                    continue
            due.append((output.request_id, output, state))
        if self._holding and self._merge_when_behind and not self._events.queued_steps():
            # Caught up: what was held only because the responses were behind goes out now.
            for request_id in list(self._holding):
                state = self._states.get(request_id)
                if state is not None and state.held_outputs >= self._interval(state):
                    due.append((request_id, self._release(request_id, state), state))
        self._send(due, event)

    def _interval(self, state: RequestState) -> int:
        return max(state.request.stream_interval or self._stream_interval, self._merged_interval)

    def _hold_or_release(self, output: EngineOutput, state: RequestState) -> EngineOutput | None:
        """The output to send now for a streamed request (its held outputs merged in), or None to hold it."""
        holds = self._merge_when_behind or self._stream_interval > 1 or (state.request.stream_interval or 1) > 1
        if state.held is None and not holds:
            return output  # the per-step contract: nothing to merge, nothing to hold
        state.held = output if state.held is None else merge_deltas(state.held, output)
        state.held_outputs += 1
        if state.first:
            return self._release(output.request_id, state)  # the first token is never held (time to first token)
        behind = self._merge_when_behind and self._events.queued_steps() > 0
        if not output.finished and (
            state.held_outputs < self._interval(state) or (behind and state.held_outputs < self._events.max_steps)
        ):
            self._holding.add(output.request_id)
            return None
        return self._release(output.request_id, state)

    def _release(self, request_id: str, state: RequestState) -> EngineOutput:
        output, state.held, state.held_outputs = state.held, None, 0
        self._holding.discard(request_id)
        return output  # type: ignore[return-value]  # only a request holding an output is released

    def _send_held(self, request_ids: list[str]) -> None:
        """Send the held outputs of these requests as they are (not FINAL): before their error."""
        due = []
        for request_id in request_ids:
            state = self._states.get(request_id)
            if state is not None and state.held is not None:
                due.append((request_id, self._release(request_id, state), state))
        if due:
            self._send(due, None)

    def _send(self, due: list[tuple[str, EngineOutput, RequestState]], event: StepOutputs | None) -> None:
        """Encode and send one response per entry; a finished output's response is its request's FINAL."""
        # CPU time of this thread, not wall time: a send also waits for tritonserver's answer, and
        # that wait costs the engine nothing; building and sending responses does (cores, GIL).
        self.caller.check("sending responses")
        started = time.thread_time()
        ready: list[tuple[EngineOutput, RequestState, Any, bool]] = []
        for request_id, output, state in due:
            finished = output.finished
            # The prompt as vLLM counts it: each image placeholder expanded to the image's tokens, or a
            # text prompt the engine tokenized (a V1 model's).
            engine_counts = state.first and (state.request.images or not state.request.prompt_token_ids)
            if engine_counts and output.prompt_tokens is not None:
                state.request.engine_prompt_tokens = output.prompt_tokens
                if state.timing is not None:
                    state.timing.prompt_tokens = state.request.engine_prompt_tokens
            try:
                tapped = self._tapped(state)
                arrays = codec.encode_response(output, state.request, state.first, self.window_decode)
                if tapped:
                    response: Any = TappedResponse(tap_writer.plain_values(arrays))
                else:
                    response = triton_io.response(self._pb, arrays)
            except OSError as error:  # its output tap's connection failed since its first response
                self._abort(request_id)
                self.fail(request_id, str(error), self._pb.TritonError.UNAVAILABLE)
                continue
            except Exception as error:
                logger.exception("could not encode response for %s", request_id)
                self._abort(request_id)
                self.fail(request_id, f"internal error encoding the response: {error}", self._pb.TritonError.INTERNAL)
                continue
            state.first = False
            if finished:
                with self._lock:
                    self._states.pop(request_id, None)
            ready.append((output, state, response, finished))
        if self._observer is not None:
            self._observe(event, ready)
        ready = self._write_taps(ready)
        for output, state, response, finished in ready:
            if isinstance(response, TappedResponse):
                if not finished:
                    continue  # its data went to the tap: the FINAL alone goes through Triton
                response = None
            try:
                state.sender.send(response, flags=self._final if finished else 0)
            except Exception as error:
                if finished:
                    # The stub closed the sender before its IPC: nothing more can go to this request.
                    logger.warning("the final response of %s was reported failed: %s", output.request_id, error)
                    continue
                # The client may be gone, or Triton's IPC failed: either way the request ends here,
                # with an error FINAL if one still gets through (never a stream left without an end).
                logger.warning("a response of %s could not be sent (%s): ending it", output.request_id, error)
                self._abort(output.request_id)
                self.fail(
                    output.request_id, f"internal error sending a response: {error}", self._pb.TritonError.INTERNAL
                )
        if self._adaptive is not None and event is not None:
            self._adaptive.observe(len(ready), time.thread_time() - started, event.step_seconds)
        if self._observer is not None and event is not None:
            self._observer.on_step(event, time.perf_counter())

    def _tapped(self, state: RequestState) -> bool:
        """Whether this response goes to the request's output tap; raises OSError when the connection
        its earlier responses took has failed since."""
        tap = state.request.tap
        if tap is None:
            return False
        if state.first:
            state.tap_connection = self._taps.connection(tap.socket)
            return state.tap_connection is not None
        if state.tap_connection is None:
            return False
        if self._taps.connection_id(tap.socket) != state.tap_connection:
            raise OSError(tap_failed_message(tap.socket))
        return True

    def _write_taps(
        self, ready: list[tuple[EngineOutput, RequestState, Any, bool]]
    ) -> list[tuple[EngineOutput, RequestState, Any, bool]]:
        """One frame per tap socket with this step's tapped responses (before any FINAL goes through
        Triton); the requests of a frame that could not be written fail. Returns what is left to send."""
        frames: dict[str, list[tuple[str, dict[str, list[Any]], bool]]] = {}
        for _, state, response, finished in ready:
            if isinstance(response, TappedResponse):
                tap = state.request.tap
                frames.setdefault(tap.socket, []).append((tap.key, response.values, finished))
        failed: set[str] = set()
        for path, entries in frames.items():
            try:
                self._taps.send(path, entries)
            except OSError as error:
                logger.warning("writing to output tap %s failed (%s): ending its requests", path, error)
                failed.add(path)
        if not failed:
            return ready
        left = []
        for output, state, response, finished in ready:
            if isinstance(response, TappedResponse) and state.request.tap.socket in failed:
                self._abort(output.request_id)
                with self._lock:
                    self._states.pop(output.request_id, None)  # a finished one is popped already
                message = tap_failed_message(state.request.tap.socket)
                self._error_final(output.request_id, state, message, self._pb.TritonError.UNAVAILABLE)
                continue
            left.append((output, state, response, finished))
        return left

    def _observe(self, event: StepOutputs | None, ready: list[tuple[EngineOutput, RequestState, Any, bool]]) -> None:
        """Record the responses about to be sent; flush first if any is a FINAL.

        A client that scrapes the metrics once it has its FINAL must find its request counted, so
        the flush comes before the sends (one flush for all FINALs of the step).
        """
        now = time.time()
        finals = False
        for output, state, _, finished in ready:
            if state.timing is None:
                continue
            engine_first = None if state.request.stream else output.first_token_time
            self._observer.on_response(
                state.timing,
                [(c.index, len(c.token_ids)) for c in output.outputs],
                finished,
                now,
                engine_first,
                event.unreturned.get(output.request_id, (0, 0)) if finished and event is not None else (0, 0),
                output.times,
            )
            finals = finals or finished
        if finals:
            try:
                self._observer.flush()
            except Exception:
                logger.exception("flushing metrics failed")

    def _cancelled(self, request_id: str, state: RequestState, now: float) -> bool:
        self.caller.check("asking whether a request is cancelled")
        state.last_cancel_check = now
        if not state.sender.is_cancelled():
            return False
        logger.info("request %s cancelled by its client: aborted in the engine", request_id)
        self._abort(request_id)
        self.fail(request_id, "Request was cancelled by the client", self._pb.TritonError.CANCELLED)
        return True

    def _sweep_cancelled(self) -> None:
        """Ask Triton about the requests checked least recently, within the sweep's budget."""
        now = time.monotonic()
        with self._lock:
            due = [
                (s.last_cancel_check, rid, s)
                for rid, s in self._states.items()
                if now - s.last_cancel_check >= CANCEL_CHECK_SECONDS
            ]
        if len(due) > CANCEL_CHECKS_PER_SWEEP:
            due = heapq.nsmallest(CANCEL_CHECKS_PER_SWEEP, due, key=lambda item: item[0])
        for _, request_id, state in due:
            self._cancelled(request_id, state, now)
