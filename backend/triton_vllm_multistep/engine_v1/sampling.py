"""The request's plain sampling fields (engine/events.EngineRequest.sampling, vLLM 0.8.5's names)
→ vLLM V1's SamplingParams (an embedding request's pooling fields → its PoolingParams), and the V1
engine's refusals of what it no longer has.

Owns the renames between the two engines' parameters (V0's `guided_decoding` is V1's
`structured_outputs`) and the errors for fields V1 removed; must not change what a field means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class UnsupportedOnV1(ValueError):
    """A request field vLLM's V1 engine does not have (the message names it and the engine)."""


# V0 fields V1 removed, and why a request that sets them cannot be served exactly.
REMOVED_FIELDS = {
    "best_of": "vLLM's V1 engine removed best_of (use n)",
    "use_beam_search": "vLLM's V1 engine has no beam search in a request's sampling parameters",
}
# A field set to its V0 default is no request for it: accepted.
REMOVED_DEFAULTS: dict[str, Any] = {"best_of": None, "use_beam_search": False}


def v1_sampling_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of V1's SamplingParams for `fields` (plain JSON values). Raises
    UnsupportedOnV1 for a field V1 removed."""
    values = dict(fields)
    for name, why in REMOVED_FIELDS.items():
        if name in values:
            value = values.pop(name)
            if value != REMOVED_DEFAULTS[name] and not (name == "best_of" and value == values.get("n", 1)):
                raise UnsupportedOnV1(f"{name}={value!r}: {why}")
    guided = values.pop("guided_decoding", None)
    if guided:
        values["structured_outputs"] = {key: value for key, value in guided.items() if value is not None}
    if "logit_bias" in values and values["logit_bias"] is not None:
        values["logit_bias"] = {int(token): bias for token, bias in values["logit_bias"].items()}
    return values


def sampling_params(fields: Mapping[str, Any]) -> Any:
    """V1's SamplingParams for a request's plain fields (imports vLLM: the V1 environment only)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    values = v1_sampling_fields(fields)
    if "output_kind" in values:
        values["output_kind"] = RequestOutputKind[values["output_kind"]]
    if "structured_outputs" in values:
        values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
    return SamplingParams(**values)


def pooling_params(fields: Mapping[str, Any]) -> Any:
    """V1's PoolingParams for an embedding request's plain fields (`dimensions`, checked by vLLM against
    the model when the request is added: only models trained for it may shorten their vector)."""
    from vllm.pooling_params import PoolingParams

    return PoolingParams(task="embed", **fields)
