"""The response thread with a fake pb_utils: exactly one FINAL per request, whatever ends it, and
deltas sent in the order the engine produced them.

The real thing (tritonserver, cancellation over gRPC, engine failure, drains) is in the e2e tier;
here the thread runs as in the stub, fed with the engine events it gets there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import fake_pb_utils as pb
import pytest

from triton_vllm_multistep.engine.events import Completion, EngineDied, EngineOutput, RequestFailed, StepOutputs
from triton_vllm_multistep.stub.codec import GenerationRequest
from triton_vllm_multistep.stub.responder import RequestState, Responder
from triton_vllm_multistep.stub.triton_io import TritonCaller, WrongThreadError
from triton_vllm_multistep.testing.polling import wait_for


class Harness:
    """A started Responder, the requests registered with it and what it asked the engine to abort."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.responder = Responder(pb, abort=self.aborted.append)
        self.senders: dict[str, pb.ResponseSender] = {}
        self.responder.start()

    def register(self, request_id: str, stream: bool = True) -> pb.ResponseSender:
        sender = pb.ResponseSender()
        generation = GenerationRequest(prompt_token_ids=[1, 2, 3], sampling_params=None, stream=stream)
        assert self.responder.register(request_id, RequestState(sender=sender, request=generation))
        self.senders[request_id] = sender
        return sender

    def step(self, *deltas: tuple[str, str, list[int], bool]) -> None:
        """One engine step: (request id, text, token ids, finished) per request in it."""
        outputs = [
            EngineOutput(rid, [Completion(0, text, ids, None, None)], finished, prompt_tokens=3)
            for rid, text, ids, finished in deltas
        ]
        self.responder.post(StepOutputs(outputs, step_seconds=0.001))

    def stop(self) -> None:
        self.responder.stop("stopping")


@pytest.fixture
def harness() -> Iterator[Harness]:
    handle = Harness()
    yield handle
    handle.stop()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    return wait_for(condition, timeout, interval=0.01)


def texts(sender: pb.ResponseSender) -> list[str]:
    return [b"".join(r.arrays()["text_output"].tolist()).decode() for r in sender.responses() if not r.has_error()]


def error_of(sender: pb.ResponseSender) -> pb.TritonError:
    (response, flags), *_ = [(r, f) for r, f in sender.sent if r.has_error()]
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    return response.error()


def test_deltas_go_out_in_engine_order_and_the_last_is_the_only_final(harness: Harness) -> None:
    a, b = harness.register("a"), harness.register("b")
    harness.step(("a", "one", [10], False), ("b", "uno", [20], False))
    harness.step(("a", " two", [11], False), ("b", " dos", [21], True))
    harness.step(("a", " three", [12], True))
    harness.stop()  # ends whatever would still be in flight: nothing is
    assert texts(a) == ["one", " two", " three"]
    assert texts(b) == ["uno", " dos"]
    assert [flags for _, flags in a.sent] == [0, 0, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert [r.arrays()["output_ids"].tolist() for r in a.responses()] == [[10], [11], [12]]
    assert b.finals == 1 and harness.responder.in_flight() == 0
    assert harness.aborted == []


def test_a_request_the_engine_refuses_gets_one_invalid_arg_final(harness: Harness) -> None:
    sender = harness.register("r")
    harness.step(("r", "x", [5], False))
    harness.responder.post(RequestFailed("r", "prompt too long for the KV cache"))
    harness.step(("r", "late", [6], True))  # whatever the engine still says is dropped
    harness.stop()
    assert sender.finals == 1 and len(sender.sent) == 2
    error = error_of(sender)
    assert error.code() == pb.TritonError.INVALID_ARG and "prompt too long" in error.message()


def test_engine_death_ends_every_request_in_flight_once(harness: Harness) -> None:
    a, b, done = harness.register("a"), harness.register("b"), harness.register("done")
    harness.step(("a", "x", [1], False), ("done", "y", [2], True))
    harness.responder.post(EngineDied("the engine failed: boom", ["a", "b"]))
    harness.stop()  # posts its own EngineDied: nobody gets a second FINAL
    for sender in (a, b):
        assert sender.finals == 1
        error = error_of(sender)
        assert error.code() == pb.TritonError.UNAVAILABLE and "boom" in error.message()
    assert done.finals == 1 and not any(r.has_error() for r in done.responses())


def test_after_an_engine_death_the_hook_runs_once_every_error_is_sent_and_not_on_stop(harness: Harness) -> None:
    """The stub unloads the model from this hook: Triton 2.51 must not start unloading while errors go out."""
    a, b = harness.register("a"), harness.register("b")
    finals_when_called: list[tuple[str, int]] = []
    harness.responder.after_engine_death = lambda message: finals_when_called.append((message, a.finals + b.finals))
    harness.responder.post(EngineDied("the engine failed: boom", ["a", "b"]))
    assert wait_until(lambda: finals_when_called == [("the engine failed: boom", 2)])
    harness.stop()  # the stop's own EngineDied is not an engine failure
    assert finals_when_called == [("the engine failed: boom", 2)]


def test_the_engine_death_hook_is_not_called_by_a_stop_without_a_failure() -> None:
    handle = Harness()
    called: list[str] = []
    handle.responder.after_engine_death = called.append
    handle.register("a")
    handle.stop()
    assert handle.senders["a"].finals == 1 and called == []


def test_end_requests_aborts_them_then_sends_one_unavailable_final(harness: Harness) -> None:
    a = harness.register("a")
    harness.step(("a", "x", [1], False))
    harness.responder.end_all("the server is about to stop")
    assert wait_until(lambda: a.finals == 1)
    harness.step(("a", "after", [2], True))  # the engine's next output for it: already ended
    harness.stop()
    assert a.finals == 1 and texts(a) == ["x"]
    assert harness.aborted == ["a"]
    assert error_of(a).code() == pb.TritonError.UNAVAILABLE
    assert error_of(a).message() == "the server is about to stop"


def test_a_cancelled_request_is_aborted_and_gets_one_cancelled_final(harness: Harness) -> None:
    a, b = harness.register("a"), harness.register("b")
    harness.step(("a", "x", [1], False), ("b", "y", [2], False))
    a.cancelled = True
    assert wait_until(lambda: a.finals == 1)  # the periodic sweep asks is_cancelled()
    harness.step(("a", "more", [3], True), ("b", "z", [4], True))
    harness.stop()
    assert harness.aborted == ["a"]
    assert error_of(a).code() == pb.TritonError.CANCELLED and a.finals == 1 and texts(a) == ["x"]
    assert b.finals == 1 and texts(b) == ["y", "z"]


def test_a_client_gone_on_send_is_aborted_and_not_sent_to_again(harness: Harness) -> None:
    sender = harness.register("a")
    sender.fail_sends = True
    harness.step(("a", "x", [1], False))
    assert wait_until(lambda: harness.aborted == ["a"])
    assert harness.responder.in_flight() == 0
    harness.stop()
    assert sender.sent == []


def test_after_intake_closes_no_request_is_registered_and_errors_are_final() -> None:
    responder = Responder(pb, abort=lambda _: None)
    responder.close_intake("draining")
    generation = GenerationRequest(prompt_token_ids=[1], sampling_params=None, stream=True)
    assert not responder.register("late", RequestState(sender=pb.ResponseSender(), request=generation))
    assert responder.intake_closed == "draining" and responder.in_flight() == 0
    sender = pb.ResponseSender()
    responder.send_error(sender, "not taking new requests", pb.TritonError.UNAVAILABLE)
    assert sender.finals == 1 and error_of(sender).message() == "not taking new requests"


def test_end_asked_from_many_threads_at_once_sends_one_final_from_the_response_thread(harness: Harness) -> None:
    sender = harness.register("r")
    threads = [
        threading.Thread(target=harness.responder.end, args=("r", "gone", pb.TritonError.UNAVAILABLE)) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wait_until(lambda: sender.finals == 1)
    harness.stop()
    assert sender.finals == 1 and error_of(sender).message() == "gone"
    assert sender.threads == {"triton-responder"}


def test_refusals_from_execute_threads_are_sent_by_the_response_thread(harness: Harness) -> None:
    senders = [pb.ResponseSender() for _ in range(4)]
    threads = [
        threading.Thread(target=harness.responder.refuse, args=(s, f"bad {i}", pb.TritonError.INVALID_ARG))
        for i, s in enumerate(senders)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wait_until(lambda: all(s.finals == 1 for s in senders))
    harness.stop()
    for index, sender in enumerate(senders):
        assert sender.threads == {"triton-responder"}
        assert error_of(sender).message() == f"bad {index}" and error_of(sender).code() == pb.TritonError.INVALID_ARG


def test_a_call_into_triton_from_a_thread_that_does_not_own_the_calls_is_refused(harness: Harness) -> None:
    sender = pb.ResponseSender()
    raised: list[BaseException] = []

    def send_from_here() -> None:
        try:
            harness.responder.send_error(sender, "from the wrong thread", pb.TritonError.INTERNAL)
        except WrongThreadError as error:
            raised.append(error)

    thread = threading.Thread(target=send_from_here, name="some-feature-thread")
    thread.start()
    thread.join()
    assert len(raised) == 1 and "some-feature-thread" in str(raised[0]) and "triton-responder" in str(raised[0])
    assert sender.sent == [] and sender.threads == set()


def test_the_calls_into_triton_pass_to_the_response_thread_and_back_to_the_thread_that_stops_it() -> None:
    caller = TritonCaller()
    responder = Responder(pb, abort=lambda _: None, caller=caller)
    assert caller.owner is threading.current_thread()
    responder.start()
    assert caller.owner.name == "triton-responder"
    with pytest.raises(WrongThreadError):
        caller.check("a metrics push")
    responder.stop("stopping")
    assert caller.owner is threading.current_thread()
    caller.check("closing the metrics")  # finalize's thread may call again


def test_engine_death_is_counted_before_the_errors_and_quiesce_ends_the_optional_calls() -> None:
    """Metrics hear of the failure first (on the response thread), then each request its error; after
    quiesce() (the model's unload is asked) no heartbeat, flush or cancellation check reaches Triton."""
    order: list[str] = []

    class Observer:
        def on_engine_died(self) -> None:
            order.append(f"died on {threading.current_thread().name}")

        def maybe_flush(self, now: float) -> None:
            order.append("flush")

        def flush(self) -> None:
            pass

    responder = Responder(pb, abort=lambda _: None, observer=Observer())
    beats: list[float] = []
    responder.heartbeat = beats.append
    sender = pb.ResponseSender()
    generation = GenerationRequest(prompt_token_ids=[1], sampling_params=None, stream=True)
    responder.register("a", RequestState(sender=sender, request=generation))
    responder.after_engine_death = lambda message: (order.append(f"errors sent: {sender.finals}"), responder.quiesce())
    responder.start()
    assert wait_until(lambda: beats and "flush" in order)
    responder.post(EngineDied("the engine failed: boom", ["a"]))
    assert wait_until(lambda: any(entry.startswith("errors sent") for entry in order))
    deaths = [i for i, entry in enumerate(order) if entry.startswith("died")]
    assert order[deaths[0]] == "died on triton-responder" and order[-1] == "errors sent: 1"
    quiet_from, beats_then = len(order), len(beats)
    cancel_checks = sender.cancel_checks
    time.sleep(0.3)  # several turns of the response thread's loop (every 50 ms)
    responder.stop("stopping")
    assert order[quiet_from:] == [] and len(beats) == beats_then and sender.cancel_checks == cancel_checks


def test_a_send_that_fails_once_ends_the_stream_with_an_error_final(harness: Harness) -> None:
    """A failed send (Triton's IPC, not a client gone) never leaves the client without an end."""
    sender = harness.register("a")
    real_send = sender.send
    failures = [RuntimeError("An error occurred while sending a response.")]

    def send_failing_once(response: pb.InferenceResponse | None = None, flags: int = 0) -> None:
        if failures:
            raise failures.pop()
        real_send(response, flags)

    sender.send = send_failing_once  # type: ignore[method-assign]
    harness.step(("a", "x", [1], False))
    assert wait_until(lambda: sender.finals == 1)
    harness.step(("a", "y", [2], True))  # the engine's next output: the request has ended
    harness.stop()
    assert harness.aborted == ["a"] and sender.finals == 1
    assert error_of(sender).code() == pb.TritonError.INTERNAL
    assert "An error occurred while sending a response." in error_of(sender).message()
