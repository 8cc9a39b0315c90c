"""vLLM's EngineArgs from a model's settings: model.json's fields checked against the installed
vLLM's, then built, each refusal a load error naming model.json.

Owns the engine-side half of reading engine arguments (settings/ reads and fills them without
vLLM); imports vLLM only inside its functions, so the stub can import it before it turns IPEX off.
Must not know Triton.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from triton_vllm_multistep.settings.engine_json import ASYNC_ONLY_ENGINE_ARGS
from triton_vllm_multistep.settings.model import ModelSettings
from triton_vllm_multistep.settings.parameters import ConfigError

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

logger = logging.getLogger("triton_vllm_multistep")


def engine_fields(engine_json: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """model.json fields for EngineArgs (`known`): AsyncEngineArgs-only ones dropped (logged), unknown refused."""
    unknown = sorted(set(engine_json) - known - set(ASYNC_ONLY_ENGINE_ARGS))
    if unknown:
        raise ConfigError(
            f"model.json: unknown vLLM engine argument(s): {', '.join(unknown)} "
            "(accepted: the fields of vLLM 0.8.5's AsyncEngineArgs)"
        )
    values = dict(engine_json)
    for name, why in ASYNC_ONLY_ENGINE_ARGS.items():
        if name in values and name not in known:
            logger.info("vllm_multistep: model.json field %r is ignored: %s", name, why)
            del values[name]
    return values


def engine_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's keyword arguments (ModelSettings.engine_args) that the installed vLLM's EngineArgs
    takes, plain JSON values (what an engine process is sent); unknown fields refused."""
    from vllm.engine.arg_utils import EngineArgs

    return engine_fields(values, {field.name for field in dataclasses.fields(EngineArgs)})


def to_engine_args(values: Mapping[str, Any]) -> EngineArgs:
    """vLLM `EngineArgs` from engine_values(); vLLM's refusals as a load error naming model.json."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.json: {error}") from None


def engine_args_of(model: ModelSettings) -> EngineArgs:
    """vLLM `EngineArgs` of a model's settings: fields checked, then built."""
    return to_engine_args(engine_values(model.engine_args))
