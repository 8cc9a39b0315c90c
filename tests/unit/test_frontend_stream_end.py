"""frontend/triton_stream.py `end_stream`: how the OpenAI server ends its gRPC stream to a model.

A real gRPC server stands in for tritonserver (tritonclient's own service definition) and records
how each stream ended for it, so the client's protocol is seen from the server's side: an answered
stream is read to the end the server makes, never cancelled (Triton 2.51 can lose the state of a
stream cancelled while it finishes it, and that state keeps the model from unloading); an
unanswered one is cancelled at once (the backend aborts its request); an answered stream the
server does not end is cancelled after the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import aio as grpcaio
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_vllm_multistep.frontend.triton_stream import end_stream


class OneAnswerServer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers a stream's request with one FINAL response (`answer`), or takes `linger` s to (not
    `answer`: still generating); ends the stream `linger` s after the FINAL."""

    def __init__(self, linger: float, answer: bool) -> None:
        self.linger = linger
        self.answer = answer
        self.endings: list[str] = []  # per stream: "ended" (the server ended it) or "cancelled" (the client)
        self.received = asyncio.Event()
        self.ended = asyncio.Event()

    async def ModelStreamInfer(  # the service's method name
        self, request_iterator: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        try:
            async for request in request_iterator:
                self.received.set()
                if not self.answer:
                    await asyncio.sleep(self.linger)
                response = service_pb2.ModelStreamInferResponse()
                response.infer_response.model_name = request.model_name
                response.infer_response.parameters["triton_final_response"].bool_param = True
                yield response
            await asyncio.sleep(self.linger)  # the server finishing the stream after the FINAL
            self.endings.append("ended")
        except asyncio.CancelledError:
            self.endings.append("cancelled")
            raise
        finally:
            self.ended.set()


async def _stream_then_end(linger: float, read_final: bool, timeout: float = 5.0) -> tuple[list[str], float]:
    """One stream to a OneAnswerServer: its FINAL read (or not), then `end_stream`; the server's record
    of how it ended and how long end_stream took."""
    server = grpc.aio.server()
    servicer = OneAnswerServer(linger, answer=read_final)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpcaio.InferenceServerClient(f"127.0.0.1:{port}") as client:

            async def one_request():
                yield {"model_name": "m", "inputs": []}

            responses = client.stream_infer(one_request())
            answered = False
            await asyncio.wait_for(servicer.received.wait(), 5)
            if read_final:
                result, error = await responses.__anext__()
                assert error is None
                answered = result.get_response().parameters["triton_final_response"].bool_param
            started = asyncio.get_running_loop().time()
            await end_stream(responses, answered, timeout=timeout)
            took = asyncio.get_running_loop().time() - started
            await asyncio.wait_for(servicer.ended.wait(), 5)
        return servicer.endings, took
    finally:
        await server.stop(None)


def test_an_answered_stream_is_read_to_the_end_the_server_makes_not_cancelled() -> None:
    endings, took = asyncio.run(_stream_then_end(linger=0.3, read_final=True))
    assert endings == ["ended"]
    assert took >= 0.25  # it waited for the server's end


def test_an_unanswered_stream_is_cancelled_at_once() -> None:
    endings, took = asyncio.run(_stream_then_end(linger=0.3, read_final=False))
    assert endings == ["cancelled"]
    assert took < 0.25


def test_an_answered_stream_the_server_does_not_end_is_cancelled_after_the_bound() -> None:
    endings, took = asyncio.run(_stream_then_end(linger=30.0, read_final=True, timeout=0.2))
    assert endings == ["cancelled"]
    assert 0.2 <= took < 5.0
