"""Per-config engine arguments: the `engine_args` parameter of the loaded config over model.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triton_vllm_multistep.settings import engine_json as model_json
from triton_vllm_multistep.settings import parameters

SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "vllm_model"


def _model_config(parameters: dict[str, str]) -> dict:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def _pbtxt_parameters(path: Path) -> dict[str, str]:
    """The string parameters of a config.pbtxt, read with protobuf's own text-format parser."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in message.parameters.items()}


def test_config_fields_override_model_json_and_the_rest_is_kept() -> None:
    engine_json = {"model": "demo://tiny-llama-bpe", "dtype": "float32", "max_model_len": 1024}
    merged = model_json.apply_config_engine_args(engine_json, _model_config({"engine_args": '{"dtype": "bfloat16"}'}))
    assert merged == {"model": "demo://tiny-llama-bpe", "dtype": "bfloat16", "max_model_len": 1024}
    assert engine_json["dtype"] == "float32"  # the caller's dict is not changed


def test_without_the_parameter_model_json_is_used_as_is() -> None:
    engine_json = {"model": "m", "dtype": "float16"}
    assert model_json.apply_config_engine_args(engine_json, _model_config({})) == engine_json
    assert model_json.apply_config_engine_args(engine_json, _model_config({"engine_args": "  "})) == engine_json


@pytest.mark.parametrize(("text", "message"), [("{dtype", "not valid JSON"), ('["dtype"]', "JSON object")])
def test_a_bad_parameter_is_a_load_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(parameters.ConfigError, match=f"'engine_args'.*{message}"):
        model_json.apply_config_engine_args({"model": "m"}, _model_config({"engine_args": text}))


def test_shipped_configs_give_the_gpu_bf16_and_the_cpu_fp32() -> None:
    """The shipped vllm_model: one model.json, a dtype per config (vLLM's CUDA multi-step needs bf16/fp16)."""
    engine_json = json.loads((SHIPPED_MODEL / "1" / "model.json").read_text())
    assert "dtype" not in engine_json  # one place per config, not a default that one config must undo
    gpu = model_json.apply_config_engine_args(
        engine_json, _model_config(_pbtxt_parameters(SHIPPED_MODEL / "config.pbtxt"))
    )
    cpu = model_json.apply_config_engine_args(
        engine_json, _model_config(_pbtxt_parameters(SHIPPED_MODEL / "configs" / "cpu.pbtxt"))
    )
    assert gpu["dtype"] == "bfloat16"
    assert cpu["dtype"] == "float32"
    assert {k: v for k, v in gpu.items() if k != "dtype"} == {k: v for k, v in cpu.items() if k != "dtype"}
