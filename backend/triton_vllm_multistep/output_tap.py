"""The output tap's wire contract: a request's responses sent by the stub straight to the OpenAI server
that asked for them, over a local Unix socket, instead of through tritonserver's gRPC.

Why: on the OpenAI path every streamed step of every request crossed three processes `vllm serve`
does not have (the stub's response to tritonserver, tritonserver's gRPC message, the OpenAI
server's parse of it); their CPU per token, not the engine, capped the V1 models' OpenAI path under
load (docs/performance.md). With a tap the request still goes through Triton (admission, metrics,
cancellation, its one FINAL), but its data responses, exactly the output arrays Triton would have
carried, reach the OpenAI server as one frame per engine step for all of its requests.

Owns the two request parameters that ask for it, the greeting the OpenAI server sends first (the
stub writes only to a socket that answers with it), and the frame: a 4-byte little-endian length,
then a pickle of plain values only (str, bytes, int, float, bool, None, lists, tuples, dicts), read
back with an unpickler that refuses every class. Imports nothing of the package, nor vLLM, torch or
numpy: the stub (`.venv`) and either OpenAI server (`.venv` or `.venv-v1`) read it.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Request parameters (Triton's, not sampling fields): the absolute path of the OpenAI server's tap
# socket and the key its responses are filed under there.
TAP_SOCKET_PARAMETER = "output_tap_socket"
TAP_KEY_PARAMETER = "output_tap_key"
TAP_PARAMETERS = (TAP_SOCKET_PARAMETER, TAP_KEY_PARAMETER)
# What an OpenAI server's tap sends on every new connection before anything else.
GREETING = b"triton-vllm-multistep output tap 1\n"
HEADER_BYTES = 4
MAX_FRAME_BYTES = 1 << 30
# One data response of one request: (its key, its output values by tensor name, whether it is the
# request's last data response, after which the stub sends the request's Triton FINAL).
TapEntry = tuple[str, dict[str, list[Any]], bool]


@dataclass(frozen=True)
class TapAddress:
    """Where a request's data responses go: the tap socket's path and the request's key there."""

    socket: str
    key: str


class TapRequestError(ValueError):
    """The tap parameters of a request are malformed; the message says which and how."""


def tap_address(parameters_json: str | None) -> TapAddress | None:
    """The tap a request's parameters (Triton's request-parameters JSON) ask for, or None."""
    if not parameters_json or TAP_SOCKET_PARAMETER not in parameters_json:
        return None
    try:
        parameters = json.loads(parameters_json)
    except ValueError:
        return None  # the sampling-fields reader reports malformed JSON in its words
    if not isinstance(parameters, Mapping) or not any(name in parameters for name in TAP_PARAMETERS):
        return None
    socket, key = (parameters.get(name) for name in TAP_PARAMETERS)
    if not isinstance(socket, str) or not socket.startswith("/") or not isinstance(key, str) or not key:
        raise TapRequestError(
            f"request parameters '{TAP_SOCKET_PARAMETER}' (an absolute socket path) and '{TAP_KEY_PARAMETER}' "
            "(a non-empty string) go together"
        )
    return TapAddress(socket, key)


# Leading words of the UNAVAILABLE error a request gets when its tap's connection breaks mid-request
# (stub/responder.py sends it; frontend/errors.py answers it 503: the request may be retried).
TAP_FAILED_PREFIX = "the connection to the OpenAI server's output tap"


def tap_failed_message(socket: str) -> str:
    return f"{TAP_FAILED_PREFIX} {socket} failed during this request"


def encode_frame(entries: Sequence[TapEntry]) -> bytes:
    payload = pickle.dumps(list(entries), protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(HEADER_BYTES, "little") + payload


def frame_length(header: bytes) -> int:
    length = int.from_bytes(header, "little")
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"output tap frame of {length} bytes, over {MAX_FRAME_BYTES}")
    return length


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"output tap frames hold plain values only, not {module}.{name}")


def decode_frame(payload: bytes) -> list[TapEntry]:
    """A frame's entries; raises pickle.UnpicklingError for anything but plain values."""
    entries = _PlainUnpickler(io.BytesIO(payload)).load()
    if not isinstance(entries, list):
        raise pickle.UnpicklingError("an output tap frame is a list of entries")
    return entries
