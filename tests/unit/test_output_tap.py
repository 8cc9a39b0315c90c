"""The output tap (output_tap.py): its request parameters and frames, the stub's response thread writing
a request's data responses to a real tap socket (and Triton getting only the FINAL), its fallback to
Triton when nothing answers there, and the OpenAI side's merge of the tap with the gRPC stream.

The real thing (tritonserver, a V1 model, its OpenAI server) is in tests/e2e/test_v1_served.py.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import AsyncIterator, Iterator
from datetime import date
from typing import Any, ClassVar

import fake_pb_utils as pb
import numpy as np
import pytest

from triton_vllm_multistep.engine.events import Completion, EngineOutput, StepOutputs
from triton_vllm_multistep.frontend import triton_stream
from triton_vllm_multistep.frontend.errors import EngineUnavailable
from triton_vllm_multistep.frontend.tap_listener import OutputTap, TapItem
from triton_vllm_multistep.output_tap import (
    TAP_KEY_PARAMETER,
    TAP_SOCKET_PARAMETER,
    TapAddress,
    TapRequestError,
    decode_frame,
    encode_frame,
    frame_length,
    tap_address,
)
from triton_vllm_multistep.stub import codec
from triton_vllm_multistep.stub.codec import GenerationRequest, ModelLimits, RequestError
from triton_vllm_multistep.stub.responder import RequestState, Responder
from triton_vllm_multistep.testing.output_tap import TapThread
from triton_vllm_multistep.testing.polling import wait_for


def test_the_tap_parameters_name_a_socket_and_a_key_together() -> None:
    assert tap_address(None) is None and tap_address("{}") is None
    assert tap_address(json.dumps({"temperature": 0})) is None
    asked = {TAP_SOCKET_PARAMETER: "/run/tap.sock", TAP_KEY_PARAMETER: "k1", "temperature": 0}
    assert tap_address(json.dumps(asked)) == TapAddress("/run/tap.sock", "k1")
    for wrong in ({TAP_SOCKET_PARAMETER: "relative.sock", TAP_KEY_PARAMETER: "k"}, {TAP_SOCKET_PARAMETER: "/a.sock"}):
        with pytest.raises(TapRequestError, match=TAP_KEY_PARAMETER):
            tap_address(json.dumps(wrong))


def test_a_frame_round_trips_plain_values_and_refuses_any_class() -> None:
    entries = [("k1", {"text_output": [b"hi"], "output_ids": [7, 8]}, False), ("k2", {}, True)]
    frame = encode_frame(entries)
    assert frame_length(frame[:4]) == len(frame) - 4
    assert decode_frame(frame[4:]) == entries
    with pytest.raises(pickle.UnpicklingError, match="plain values only"):
        decode_frame(pickle.dumps([("k", {"when": [date(2026, 1, 1)]}, False)]))


def test_the_stub_reads_the_tap_from_request_parameters_never_as_sampling_fields() -> None:
    limits = ModelLimits(vocab_size=100, max_model_len=64, checks_with_vllm=False)
    inputs = {"input_ids": np.array([1, 2, 3], dtype=np.int32), "stream": np.array([True])}
    parameters = json.dumps({TAP_SOCKET_PARAMETER: "/run/tap.sock", TAP_KEY_PARAMETER: "k1", "max_tokens": 4})
    request = codec.decode_request(inputs, parameters, limits, encode=None, decode=None)
    assert isinstance(request, GenerationRequest)
    assert request.tap == TapAddress("/run/tap.sock", "k1") and request.sampling["max_tokens"] == 4
    assert not set(request.sampling) & {TAP_SOCKET_PARAMETER, TAP_KEY_PARAMETER}
    with pytest.raises(RequestError, match=TAP_KEY_PARAMETER):
        codec.decode_request(inputs, json.dumps({TAP_SOCKET_PARAMETER: "x"}), limits, encode=None, decode=None)


@pytest.fixture
def tap() -> Iterator[TapThread]:
    running = TapThread()
    yield running
    running.close()


def _request(tap_socket: str | None, key: str = "k") -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=[1, 2, 3],
        sampling_params=None,
        stream=True,
        tap=None if tap_socket is None else TapAddress(tap_socket, key),
        returns=codec.ReturnFlags(finish_reason=True, num_output_tokens=True),
    )


def _step(responder: Responder, *deltas: tuple[str, str, list[int], bool]) -> None:
    outputs = [
        EngineOutput(rid, [Completion(0, text, ids, "length" if done else None, None)], done, prompt_tokens=3)
        for rid, text, ids, done in deltas
    ]
    responder.post(StepOutputs(outputs, step_seconds=0.001))


def _as_values(response: pb.InferenceResponse) -> dict[str, list[Any]]:
    return {name: array.tolist() for name, array in response.arrays().items()}


@pytest.fixture
def responder() -> Iterator[tuple[Responder, list[str]]]:
    """A started response thread and the request ids it asked the engine to abort."""
    aborted: list[str] = []
    running = Responder(pb, abort=aborted.append)
    running.start()
    yield running, aborted
    running.stop("stopping")


def _tapped_and_plain(responder: Responder, tap_socket: str) -> tuple[pb.ResponseSender, pb.ResponseSender]:
    """Request "t" naming the tap (key "k") and request "p" naming none, registered."""
    tapped, plain = pb.ResponseSender(), pb.ResponseSender()
    assert responder.register("t", RequestState(sender=tapped, request=_request(tap_socket)))
    assert responder.register("p", RequestState(sender=plain, request=_request(None)))
    return tapped, plain


def test_a_tapped_request_gets_its_data_on_the_tap_and_only_its_final_through_triton(
    tap: TapThread, responder: tuple[Responder, list[str]]
) -> None:
    """Beside a request without a tap, in the same steps: the tap gets one entry per response, with the
    values Triton would have carried; Triton gets the tapped request's FINAL alone, after its last entry."""
    running, aborted = responder
    inbox = tap.inbox("k")
    tapped, plain = _tapped_and_plain(running, tap.path)
    _step(running, ("t", "one", [10], False), ("p", "one", [10], False))
    _step(running, ("t", " two", [11, 12], True), ("p", " two", [11, 12], True))
    items = tap.items(inbox, 2)
    assert wait_for(lambda: tapped.finals == 1 and plain.finals == 1, 10)
    assert [item.final for item in items] == [False, True]
    assert [item.values for item in items] == [_as_values(r) for r in plain.responses()]
    assert items[1].values["output_ids"] == [11, 12] and items[1].values["text_output"] == [b" two"]
    assert tapped.sent == [(None, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)] and aborted == []


def test_a_tap_nobody_answers_leaves_the_responses_to_triton(
    tmp_path: Any, responder: tuple[Responder, list[str]]
) -> None:
    running, _ = responder
    tapped, _ = _tapped_and_plain(running, str(tmp_path / "none.sock"))
    _step(running, ("t", "one", [10], False))
    _step(running, ("t", " two", [11], True))
    assert wait_for(lambda: tapped.finals == 1, 10)
    assert [r.arrays()["output_ids"].tolist() for r in tapped.responses()] == [[10], [11]]


def test_a_tap_that_goes_away_mid_request_fails_that_request_alone(
    tap: TapThread, responder: tuple[Responder, list[str]]
) -> None:
    running, aborted = responder
    inbox = tap.inbox("k")
    tapped, plain = _tapped_and_plain(running, tap.path)
    _step(running, ("t", "one", [10], False))
    tap.items(inbox, 1)
    tap.call(tap.tap.close())  # the OpenAI server is gone
    for _ in range(3):  # the first writes may still fit the socket's buffer before the reset is seen
        _step(running, ("t", " more", [11], False), ("p", "x", [1], False))
    _step(running, ("p", "y", [2], True))
    assert wait_for(lambda: tapped.finals == 1 and plain.finals == 1, 10)
    ((response, _),) = tapped.sent
    assert response.has_error() and response.error().code() == pb.TritonError.UNAVAILABLE
    assert "output tap" in response.error().message() and aborted == ["t"]
    assert not any(r.has_error() for r in plain.responses())


class FakeCall:
    """A gRPC stream call: the responses given, then its end; records a cancel."""

    def __init__(self, responses: list[Any], gate: asyncio.Event | None = None) -> None:
        self._responses = responses
        self._gate = gate
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        if self._gate is not None:
            await self._gate.wait()
        for response in self._responses:
            yield response

    def cancel(self) -> None:
        self.cancelled = True


class _Param:
    def __init__(self) -> None:
        self.bool_param = False
        self.string_param = ""


class _Message:
    def __init__(self) -> None:
        self.parameters: dict[str, _Param] = {}


class _Parameters(dict):
    def __missing__(self, key: str) -> _Param:
        self[key] = _Param()
        return self[key]


def _final_response() -> Any:
    final = _Param()
    final.bool_param = True

    class Infer:
        outputs: ClassVar[list[Any]] = []
        raw_output_contents: ClassVar[list[bytes]] = []
        parameters: ClassVar[dict[str, Any]] = {"triton_final_response": final}

    class Response:
        error_message = ""
        infer_response = Infer()

    return Response()


def _streams(call: FakeCall) -> tuple[triton_stream.ModelStreams, list[Any]]:
    sent: list[Any] = []

    class Stub:
        def ModelStreamInfer(self, messages: Any) -> FakeCall:
            sent.append(messages)
            return call

    class Client:
        _client_stub = Stub()

    streams = triton_stream.ModelStreams(Client(), "m")
    message = _Message()
    message.parameters = _Parameters()
    streams._request_message = lambda *_: message  # type: ignore[method-assign]
    return streams, [message]


def test_the_openai_side_waits_for_the_taps_last_entry_when_tritons_final_overtakes_it() -> None:
    async def run_with_feed() -> tuple[list[Any], Any, bool]:
        tap = OutputTap()
        tap.path = "/run/tap.sock"
        gate = asyncio.Event()
        call = FakeCall([_final_response()], gate)
        streams, (message,) = _streams(call)
        request = triton_stream.generation_request([1, 2], {}, stream=True)
        responses = streams.responses("r", request, tap)
        first = asyncio.ensure_future(responses.__anext__())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        key = message.parameters[TAP_KEY_PARAMETER].string_param
        assert message.parameters[TAP_SOCKET_PARAMETER].string_param == tap.path and key
        gate.set()  # Triton's FINAL first
        await asyncio.sleep(0.05)
        tap._inboxes[key].put_nowait(TapItem({"output_ids": [5]}, False))
        tap._inboxes[key].put_nowait(TapItem({"output_ids": [6]}, True))
        got = [await first] + [values async for values in responses]
        return got, message, call.cancelled

    got, _, cancelled = asyncio.run(run_with_feed())
    assert got == [{"output_ids": [5]}, {"output_ids": [6]}] and not cancelled


def test_the_openai_side_cancels_the_stream_of_a_client_that_left_and_fails_a_lost_last_entry() -> None:
    async def left() -> bool:
        tap = OutputTap()
        tap.path = "/run/tap.sock"
        call = FakeCall([], asyncio.Event())  # Triton says nothing yet
        streams, (message,) = _streams(call)
        responses = streams.responses("r", triton_stream.generation_request([1], {}, stream=True), tap)
        waiting = asyncio.ensure_future(responses.__anext__())
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await responses.aclose()
        return call.cancelled and not tap._inboxes

    assert asyncio.run(left())

    async def lost() -> None:
        tap = OutputTap()
        tap.path = "/run/tap.sock"
        streams, _ = _streams(FakeCall([_final_response()]))
        async for _ in streams.responses("r", triton_stream.generation_request([1], {}, stream=True), tap):
            pass

    original = triton_stream.STREAM_END_SECONDS
    triton_stream.STREAM_END_SECONDS = 0.1
    try:
        with pytest.raises(EngineUnavailable, match="never reached"):
            asyncio.run(lost())
    finally:
        triton_stream.STREAM_END_SECONDS = original
