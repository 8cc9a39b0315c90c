"""The bounded queue between the engine thread and the response thread: backpressure, order, no deadlock at stop.

A small fake of triton_python_backend_utils stands in for the stub (only Triton can run the real one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from triton_vllm_multistep.engine.events import Completion, EngineDied, EngineOutput, StepOutputs
from triton_vllm_multistep.stub import codec, responder
from triton_vllm_multistep.stub.responder import EventQueue, RequestState, Responder

WAIT = 30.0  # generous: only reached if the code under test is broken


class FakeTritonError:
    CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE = "CANCELLED", "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message: str, code: str) -> None:
        self.message, self.code = message, code


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TritonError = FakeTritonError

    class Tensor:
        def __init__(self, name: str, array: Any) -> None:
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors: list | None = None, error: FakeTritonError | None = None) -> None:
            self.tensors = {t.name: t.array for t in output_tensors or []}
            self.error = error


class Sender:
    """Records (token ids or error, final?) per send; `gate` (when set) holds every send until opened."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.sent: list[tuple[Any, bool]] = []
        self.gate = gate
        self.sending = threading.Event()

    def send(self, response: FakePbUtils.InferenceResponse, flags: int = 0) -> None:
        self.sending.set()
        if self.gate is not None:
            self.gate.wait(WAIT)
        payload = response.error.code if response.error else response.tensors["output_ids"].tolist()
        self.sent.append((payload, flags == FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        return False


def step(request_id: str, token: int, finished: bool = False) -> StepOutputs:
    completion = Completion(0, str(token), [token])
    return StepOutputs([EngineOutput(request_id, [completion], finished)], 0.001)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def make_responder(max_steps: int, senders: dict[str, Sender]) -> tuple[Responder, list[str]]:
    aborted: list[str] = []
    server = Responder(FakePbUtils, abort=aborted.append, max_queued_steps=max_steps)
    for request_id, sender in senders.items():
        request = codec.GenerationRequest(prompt_token_ids=[1, 2], sampling_params=None, stream=True)
        assert server.register(request_id, RequestState(sender=sender, request=request))
    return server, aborted


def test_queue_holds_at_most_max_steps_and_the_next_step_waits_for_room() -> None:
    events = EventQueue(max_steps=3)
    for token in range(3):
        assert events.put_step(step("a", token))
    assert events.put(EngineDied("not a step: never waits", []))  # control items are not counted
    producer = threading.Thread(target=events.put_step, args=(step("a", 3),))
    producer.start()
    wait_for(lambda: events.waiting == 1)  # blocked in put_step, not merely slow
    assert events.queued_steps() == 3
    first = events.get(timeout=1)
    assert isinstance(first, StepOutputs) and first.outputs[0].outputs[0].token_ids == [0]
    producer.join(WAIT)
    assert not producer.is_alive() and events.queued_steps() == 3
    order = [events.get(timeout=1) for _ in range(4)]
    assert [type(e).__name__ for e in order] == ["StepOutputs", "StepOutputs", "EngineDied", "StepOutputs"]
    assert events.get(timeout=0.01) is responder._NOTHING


def test_close_releases_a_waiting_put_and_refuses_later_ones() -> None:
    events = EventQueue(max_steps=1)
    assert events.put_step(step("a", 0))
    results: list[bool] = []
    producer = threading.Thread(target=lambda: results.append(events.put_step(step("a", 1))))
    producer.start()
    wait_for(lambda: events.waiting == 1)
    events.close()
    producer.join(WAIT)
    assert results == [False] and not producer.is_alive()
    assert events.put_step(step("a", 2)) is False and events.put(None) is False


def test_queue_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        EventQueue(max_steps=0)


def test_slow_response_path_makes_the_engine_wait_and_loses_or_reorders_nothing() -> None:
    gate = threading.Event()
    senders = {"a": Sender(gate), "b": Sender(gate)}
    server, _ = make_responder(max_steps=2, senders=senders)
    server.start()
    steps = 12
    engine = threading.Thread(
        target=lambda: [
            server.post(step(rid, token, finished=token == steps - 1)) for token in range(steps) for rid in ("a", "b")
        ],
        name="fake-engine",
    )
    engine.start()
    try:
        # The response thread holds one step in send(); two more are queued; the engine waits.
        wait_for(lambda: senders["a"].sending.is_set() and server._events.waiting == 1)
        wait_for(lambda: server.queued_steps() == 2)  # the engine's wait ends only once the gate opens
        assert server._events.waiting == 1 and engine.is_alive()
    finally:
        gate.set()
    engine.join(WAIT)
    assert not engine.is_alive()
    wait_for(lambda: server.in_flight() == 0)
    server.stop("test over")
    for sender in senders.values():
        assert sender.sent == [([token], token == steps - 1) for token in range(steps)]


def test_stop_while_the_engine_waits_on_a_full_queue_and_the_sender_hangs_does_not_deadlock() -> None:
    gate = threading.Event()
    sender = Sender(gate)
    server, _ = make_responder(max_steps=1, senders={"a": sender})
    server.start()
    engine = threading.Thread(target=lambda: [server.post(step("a", token)) for token in range(1000)])
    engine.start()
    try:
        wait_for(lambda: sender.sending.is_set() and server._events.waiting == 1)
        server.stop("unloading", timeout=0.2)  # the response thread is stuck in send(): stop gives up on it
        engine.join(WAIT)
        assert not engine.is_alive(), "the engine thread still waits on the queue after stop"
    finally:
        gate.set()
    server._thread.join(WAIT)
    assert not server._thread.is_alive()


def test_stop_with_a_full_queue_sends_what_is_queued_then_one_final_and_frees_the_engine() -> None:
    gate = threading.Event()
    sender = Sender(gate)
    server, _ = make_responder(max_steps=2, senders={"a": sender})
    server.start()
    engine = threading.Thread(target=lambda: [server.post(step("a", token)) for token in range(1000)])
    engine.start()
    wait_for(lambda: sender.sending.is_set() and server._events.waiting == 1)
    stopper = threading.Thread(target=server.stop, args=("unloading",))
    stopper.start()  # queues the stop behind the steps; does not wait for room
    gate.set()
    stopper.join(WAIT)
    engine.join(WAIT)
    assert not stopper.is_alive() and not engine.is_alive()
    finals = [payload for payload, final in sender.sent if final]
    assert finals == ["UNAVAILABLE"] and sender.sent[-1] == ("UNAVAILABLE", True)
    tokens = [payload[0] for payload, final in sender.sent if not final]
    assert tokens == list(range(len(tokens)))  # in order, none skipped before the FINAL


def test_engine_death_after_queued_steps_ends_the_request_after_its_outputs() -> None:
    gate = threading.Event()
    sender = Sender(gate)
    server, _ = make_responder(max_steps=2, senders={"a": sender})
    server.start()

    def engine_run_then_die() -> None:
        for token in range(5):
            server.post(step("a", token))
        server.post(EngineDied("vLLM engine failed: boom", ["a"]))

    engine = threading.Thread(target=engine_run_then_die)
    engine.start()
    wait_for(lambda: sender.sending.is_set() and server._events.waiting == 1)
    gate.set()
    engine.join(WAIT)
    wait_for(lambda: server.in_flight() == 0)
    server.stop("test over")
    assert sender.sent == [([token], False) for token in range(5)] + [("UNAVAILABLE", True)]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_response_thread_that_dies_never_leaves_the_engine_waiting() -> None:
    server, _ = make_responder(max_steps=1, senders={"a": Sender()})

    def crash() -> None:
        raise RuntimeError("responder bug")

    server._serve_events = crash  # type: ignore[method-assign]
    server._thread = threading.Thread(target=server._run)
    server._thread.start()
    server._thread.join(WAIT)
    engine = threading.Thread(target=lambda: [server.post(step("a", token)) for token in range(10)])
    engine.start()
    engine.join(WAIT)
    assert not engine.is_alive()
