"""Which Triton errors mean "unavailable" (HTTP 503) rather than a bad request (400).

Triton's gRPC stream hands the client an error's message only, not its code; the backend's
UNAVAILABLE answers (stub/instance.py, stub/responder.py) and Triton's own for a model that is
not loaded are told apart by their words. The app maps EngineUnavailable to 503.
"""

from __future__ import annotations

from triton_vllm_multistep.interface import UNHEALTHY_ENGINE_MESSAGE
from triton_vllm_multistep.output_tap import TAP_FAILED_PREFIX

# Leading words of the backend's UNAVAILABLE messages and Triton's for models not in service.
UNAVAILABLE_PREFIXES = (
    UNHEALTHY_ENGINE_MESSAGE,  # stub/instance.py: a request while the engine is down
    "vLLM engine failed",  # engine/loop.py: requests in flight when the engine died
    "Request for unknown model",  # Triton: the model is not loaded (unloaded after a failure)
    TAP_FAILED_PREFIX,  # stub/responder.py: the request's output tap broke
)
UNAVAILABLE_SUFFIXES = (": not taking new requests",)  # stub/instance.py: draining or unloading


class EngineUnavailable(RuntimeError):
    """The Triton model cannot serve now (engine down, model unloaded or draining): HTTP 503."""


def is_unavailable(message: str) -> bool:
    text = message.strip()
    return text.startswith(UNAVAILABLE_PREFIXES) or text.endswith(UNAVAILABLE_SUFFIXES)
