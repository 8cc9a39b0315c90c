"""pb_utils tensors ⇄ numpy arrays: a request's inputs by name, a response from output arrays.

Owns the few pb_utils calls that the LLM model and the tokenizer stages both make; must not
validate (codec does) or send anything (the responder and Triton's batch return do).
`pb_utils` is passed in: it only exists inside the Triton stub (tests pass a fake).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


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
