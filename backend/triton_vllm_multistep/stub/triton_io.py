"""pb_utils tensors ⇄ numpy arrays, and the rule of which thread may call into Triton.

Owns the few pb_utils calls that the LLM model and the tokenizer stages both make (a request's
inputs by name, a response from output arrays) and `TritonCaller`, the one-thread rule for every
pb_utils call that crosses to tritonserver; must not validate (codec does) or send anything (the
responder and Triton's batch return do). `pb_utils` is passed in: it only exists inside the Triton
stub (tests pass a fake).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


class WrongThreadError(RuntimeError):
    """A pb_utils call that crosses to tritonserver, made from a thread that does not own them."""


class TritonCaller:
    """Which one thread may make pb_utils calls that cross to tritonserver (sends, cancellation
    checks, metrics, model control) now: the thread that loads the model, then the response thread
    while it runs, then the thread that finalizes the model. Every such call checks it first.

    Why (docs/architecture.md, "One thread calls into Triton"): the order of what reaches Triton
    (a request's responses, then its FINAL, then the model's unload; the metrics a client reads once
    it has its FINAL) is then the order of one thread's code, and no new thread can break it.
    """

    def __init__(self) -> None:
        self._owner = threading.current_thread()

    @property
    def owner(self) -> threading.Thread:
        return self._owner

    def hand_to(self, thread: threading.Thread) -> None:
        """Give the calls to `thread` (the owner hands them on when it starts or has joined it)."""
        self._owner = thread

    def check(self, what: str) -> None:
        """Raise WrongThreadError unless the calling thread owns the calls."""
        current = threading.current_thread()
        if current is not self._owner:
            raise WrongThreadError(
                f"{what} from thread {current.name!r}: only {self._owner.name!r} calls into Triton now "
                "(queue it for the response thread instead)"
            )


def input_arrays(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The request's inputs among `names` that it has, as numpy arrays."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def requested_outputs(request: Any, declared: Iterable[str]) -> frozenset[str] | None:
    """The outputs the client (or the ensemble step's output_map) asked for; None: every declared
    output (Triton asks for all of them when the client names none; a stub without
    `requested_output_names` gets every output built, as before it was read)."""
    ask = getattr(request, "requested_output_names", None)
    if ask is None:
        return None
    names = frozenset(ask())
    return None if names >= frozenset(declared) else names


def response(pb_utils: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """An InferenceResponse with one output tensor per array."""
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items()])


def error_response(pb_utils: Any, message: str, code: Any) -> Any:
    """An InferenceResponse that carries only an error (`code`: a pb_utils.TritonError code)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
