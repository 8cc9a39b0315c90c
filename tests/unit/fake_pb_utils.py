"""A stand-in for `triton_python_backend_utils` (pb_utils): it exists only inside Triton's stub.

Holds the parts the stub-side code calls (Tensor, InferenceResponse, TritonError and its codes,
the FINAL flag, get_input_tensor_by_name) plus a request and a response sender that record what
was sent. Behaves as Triton 2.51's does where the code depends on it; nothing more.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # as in tritonserver.h


class TritonError(Exception):
    # Codes as pb_utils.TritonError defines them.
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"Tensor {name!r} needs a numpy array, got {type(array).__name__}")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def arrays(self) -> dict[str, np.ndarray]:
        """Test helper: output name → array."""
        return {tensor.name(): tensor.as_numpy() for tensor in self._tensors}


@dataclass
class ResponseSender:
    """Records every send(response, flags); `cancelled` is what is_cancelled() answers."""

    cancelled: bool = False
    fail_sends: bool = False  # the client is gone: send() raises
    sent: list[tuple[InferenceResponse, int]] = field(default_factory=list)
    cancel_checks: int = 0
    threads: set[str] = field(default_factory=set)  # names of the threads that called send / is_cancelled
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_sends:
            raise TritonError("the client has gone away", TritonError.UNAVAILABLE)
        with self._lock:
            self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        self.threads.add(threading.current_thread().name)
        self.cancel_checks += 1
        return self.cancelled

    @property
    def finals(self) -> int:
        with self._lock:
            return sum(1 for _, flags in self.sent if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def responses(self) -> list[InferenceResponse]:
        with self._lock:
            return [response for response, _ in self.sent]


@dataclass
class InferenceRequest:
    """What execute() gets: named input tensors, KServe parameters (JSON), an id and a sender."""

    inputs: dict[str, np.ndarray]
    parameters_json: str = "{}"
    id: str = ""
    sender: ResponseSender = field(default_factory=ResponseSender)

    def parameters(self) -> str:
        return self.parameters_json

    def request_id(self) -> str:
        return self.id

    def get_response_sender(self) -> ResponseSender:
        return self.sender


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    array = request.inputs.get(name)
    return None if array is None else Tensor(name, array)


def model_config(inputs: list[str], parameters: dict[str, str] | None = None) -> dict[str, Any]:
    """Test helper: a model config as Triton hands it to initialize() (parsed from args["model_config"])."""
    return {
        "name": "test_model",
        "input": [{"name": name} for name in inputs],
        "parameters": {key: {"string_value": value} for key, value in (parameters or {}).items()},
    }


def initialize_args(config: dict[str, Any]) -> dict[str, str]:
    return {"model_config": json.dumps(config)}
