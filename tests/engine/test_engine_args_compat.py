"""model.json accepts what Triton's vLLM backend accepts: the fields of vLLM's AsyncEngineArgs.

Checked against the installed vLLM, so an upgrade that adds AsyncEngineArgs-only fields fails here.
"""

from __future__ import annotations

import dataclasses

from triton_vllm_multistep.engine import engine_args as vllm_args
from triton_vllm_multistep.settings import engine_json as model_json


def test_the_async_only_fields_are_exactly_what_async_engine_args_adds_to_engine_args() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    engine = {field.name for field in dataclasses.fields(EngineArgs)}
    added = {field.name for field in dataclasses.fields(AsyncEngineArgs)} - engine
    assert added == set(model_json.ASYNC_ONLY_ENGINE_ARGS)
    every_field = {name: None for name in engine | added}
    assert set(vllm_args.engine_fields(every_field, engine)) == engine
