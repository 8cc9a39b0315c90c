"""Test-side clients for the real server: gRPC streaming (sync and aio) and HTTP generate.

Each call collects every response of one request so tests can check counts, deltas and FINALs.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

BOOL_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_perf_metrics",
    "return_detokenization_window",
)
PERF_METRICS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


@dataclass
class StreamResult:
    """Everything one request received."""

    responses: list[dict[str, np.ndarray]] = field(default_factory=list)
    finals: int = 0
    error: str | None = None
    first_response_at: float | None = None
    started_at: float = 0.0
    # Wall-clock nanoseconds just before the request was sent and just after its FINAL arrived.
    sent_ns: int = 0
    final_ns: int = 0

    @property
    def data_responses(self) -> list[dict[str, np.ndarray]]:
        return [r for r in self.responses if r]

    def text(self, index: int = 0) -> str:
        return "".join(r["text_output"][index].decode("utf-8") for r in self.data_responses)

    def token_ids(self) -> list[int]:
        return [int(t) for r in self.data_responses for t in r["output_ids"]]

    def perf_metrics(self) -> dict[str, int]:
        """return_perf_metrics' outputs, checked to come on the FINAL response only and to be in order
        within this client's own clock readings around the request (the server shares the host)."""
        carrying = [i for i, r in enumerate(self.responses) if "arrival_time_ns" in r]
        assert carrying == [len(self.responses) - 1], f"perf metrics in responses {carrying} of {len(self.responses)}"
        final = self.responses[-1]
        values = {name: int(final[name][0]) for name in (*PERF_METRICS, "num_cached_tokens")}
        assert final["arrival_time_ns"].dtype == np.int64 and final["num_cached_tokens"].dtype == np.uint32
        times = [values[name] for name in PERF_METRICS]
        assert self.sent_ns <= times[0] <= times[1] <= times[2] <= times[3] <= self.final_ns, (self.sent_ns, times)
        return values


def make_inputs(
    module: Any,
    prompt: str | None = None,
    input_ids: list[int] | None = None,
    sampling: dict | str | None = None,
    priority: int | None = None,
    embedding_request: dict | str | None = None,
    **flags: bool,
) -> list[Any]:
    """InferInputs for the LLM model (or an embedding model: `embedding_request`, its JSON or the object);
    `module` is tritonclient.grpc or tritonclient.grpc.aio."""
    inputs = []
    if embedding_request is not None:
        body = embedding_request if isinstance(embedding_request, str) else json.dumps(embedding_request)
        item = module.InferInput("embedding_request", [1], "BYTES")
        item.set_data_from_numpy(np.array([body.encode("utf-8")], dtype=np.object_))
        inputs.append(item)
    if priority is not None:
        item = module.InferInput("priority", [1], "INT32")
        item.set_data_from_numpy(np.array([priority], dtype=np.int32))
        inputs.append(item)
    if prompt is not None:
        item = module.InferInput("text_input", [1], "BYTES")
        item.set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
        inputs.append(item)
    if input_ids is not None:
        item = module.InferInput("input_ids", [len(input_ids)], "INT32")
        item.set_data_from_numpy(np.array(input_ids, dtype=np.int32))
        inputs.append(item)
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        item = module.InferInput("sampling_parameters", [1], "BYTES")
        item.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
        inputs.append(item)
    for name, value in flags.items():
        assert name in BOOL_FLAGS, name
        item = module.InferInput(name, [1], "BOOL")
        item.set_data_from_numpy(np.array([value]))
        inputs.append(item)
    return inputs


def _arrays(result: Any) -> dict[str, np.ndarray]:
    response = result.get_response()
    return {output.name: result.as_numpy(output.name) for output in response.outputs}


def grpc_server_ready(url: str) -> bool:
    """Triton answers "ready" over gRPC from this process (a fresh client; any failure is a no)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return bool(client.is_server_ready())
    except Exception:
        return False
    finally:
        client.close()


def grpc_generate(
    url: str,
    model: str,
    inputs: list[Any] | None = None,
    timeout: float = 120.0,
    settle: float = 0.2,
    cancel_after: int | None = None,
    cancel_when: threading.Event | None = None,
    parameters: dict | None = None,
    on_response: Callable[[], None] | None = None,
    outputs: list[str] | None = None,
    **kwargs: Any,
) -> StreamResult:
    """One request over a gRPC stream; waits `settle` s after the end to catch a second FINAL.

    `on_response` is called (on this thread) after each data response arrives; `outputs`: the
    outputs to ask for (None: all). `cancel_after` responses, or once `cancel_when` is set, the
    request is cancelled (its error: "cancelled by test"): a test holds a long request in flight
    for exactly as long as it needs, on a host of any speed."""
    inputs = inputs if inputs is not None else make_inputs(grpcclient, **kwargs)
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    result = StreamResult(started_at=time.perf_counter())
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    ended = False
    try:
        requested = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
        result.sent_ns = time.time_ns()
        client.async_stream_infer(
            model, inputs, outputs=requested, enable_empty_final_response=True, parameters=parameters
        )
        deadline = time.monotonic() + timeout
        while True:
            if not ended and (
                (cancel_after is not None and len(result.responses) >= cancel_after)
                or (cancel_when is not None and cancel_when.is_set())
            ):
                client.stop_stream(cancel_requests=True)
                result.error = "cancelled by test"
                break
            wait = settle if ended else max(0.0, deadline - time.monotonic())
            if cancel_when is not None and not ended:
                wait = min(wait, 0.02)  # looks at the event again that often
            try:
                at, item, error = events.get(timeout=wait)
            except queue.Empty:
                if ended:
                    break
                if cancel_when is not None and time.monotonic() < deadline:
                    continue
                raise TimeoutError(
                    f"no final response from {model} within {timeout} s ({len(result.responses)} responses "
                    "received): the server or the model hangs"
                ) from None
            if error is not None:
                result.error = str(error)
                result.finals += 1
                ended = True
                continue
            if result.first_response_at is None:
                result.first_response_at = at
            result.responses.append(_arrays(item))
            if on_response is not None:
                on_response()
            if item.get_response().parameters["triton_final_response"].bool_param:
                result.final_ns = result.final_ns or time.time_ns()
                result.finals += 1
                ended = True
    finally:
        # A stream without its FINAL is cancelled, not closed: closing waits for the server to end
        # the stream, which a hung server never does (the wait would be the test's whole timeout).
        client.stop_stream(cancel_requests=not ended)
        client.close()
    return result


async def aio_generate(
    client: grpcaio.InferenceServerClient, model: str, timeout: float = 120.0, **kwargs: Any
) -> StreamResult:
    """One streaming request with tritonclient.grpc.aio on a shared client, read to the stream's end.

    Never cancelled after its FINAL: Triton 2.51's gRPC frontend can lose a stream's state when a
    client cancels it while the server is finishing it (fixed upstream in 25.04, server PR 8078),
    and the lost state keeps its model from ever unloading (docs/lifecycle.md)."""
    inputs = make_inputs(grpcaio, **kwargs)
    result = StreamResult(started_at=time.perf_counter())

    async def requests_iter():
        yield {"model_name": model, "inputs": inputs, "enable_empty_final_response": True}

    # The stream ends when the server closes it, right after the FINAL (the request side is closed
    # once the one request is sent); the deadline only bounds a hung server.
    async for item, error in client.stream_infer(requests_iter(), stream_timeout=timeout):
        if error is not None:
            result.error = str(error)
            result.finals += 1
            continue
        if result.first_response_at is None:
            result.first_response_at = time.perf_counter()
        result.responses.append(_arrays(item))
        if item.get_response().parameters["triton_final_response"].bool_param:
            result.finals += 1
    return result


def http_generate(base_url: str, model: str, body: dict, stream: bool = False, timeout: float = 120) -> list[dict]:
    """HTTP generate (one JSON) or generate_stream (server-sent events, one JSON per event)."""
    endpoint = "generate_stream" if stream else "generate"
    response = requests.post(f"{base_url}/v2/models/{model}/{endpoint}", json=body, stream=stream, timeout=timeout)
    if not stream:
        return [response.json() | {"_status": response.status_code}]
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
    return events
