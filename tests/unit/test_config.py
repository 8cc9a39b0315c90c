"""Model configuration: config.pbtxt parameters → BackendSettings (errors name the parameter),
reading model.json, and resolving model paths.

Which model.json fields vLLM accepts is the engine arguments' business and is tested where the
engine is built (tests/engine); loading real models through a server is in the e2e tier.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.settings import backend, parameters
from triton_vllm_multistep.settings import engine_json as model_json
from triton_vllm_multistep.settings.backend import Limits
from triton_vllm_multistep.settings.parameters import ConfigError


def settings(parameters: dict[str, str], engine_json: dict | None = None) -> backend.BackendSettings:
    model_config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
    return backend.backend_settings(model_config, engine_json or {"model": "m"})


def test_defaults() -> None:
    assert backend.backend_settings({}, {"model": "m"}) == backend.BackendSettings()
    defaults = backend.BackendSettings()
    assert defaults.stream_mode == "step" and defaults.enable_metrics and defaults.unload_on_engine_failure
    assert defaults.unload_drain_seconds is None and defaults.limits == Limits()


def test_every_parameter_is_read() -> None:
    read = settings(
        {
            "stream_mode": " Window ",
            "cpu_kvcache_space_gib": "3",
            "enable_metrics": "off",
            "max_prompt_tokens": "100",
            "max_tokens_limit": "50",
            "max_n": "2",
            "max_request_bytes": "4096",
            "unload_on_engine_failure": "no",
            "unload_drain_seconds": "2.5",
            "use_ipex": "false",
            "tokenizer_dir": "ignored here",  # other models' parameters are not errors
        }
    )
    assert read == backend.BackendSettings(
        stream_mode="window",
        cpu_kvcache_space_gib=3,
        enable_metrics=False,
        limits=Limits(max_prompt_tokens=100, max_tokens=50, max_n=2, max_request_bytes=4096),
        unload_on_engine_failure=False,
        unload_drain_seconds=2.5,
        use_ipex=False,
    )


def test_vllms_name_for_the_stream_mode_is_an_alias() -> None:
    assert settings({}, {"model": "m", "multi_step_stream_outputs": False}).stream_mode == "window"
    assert settings({}, {"model": "m", "multi_step_stream_outputs": True}).stream_mode == "step"


@pytest.mark.parametrize("text", ["1", "true", "YES", " on "])
def test_true_spellings(text: str) -> None:
    assert settings({"enable_metrics": text}).enable_metrics is True


@pytest.mark.parametrize(
    ("text", "prefix_caching", "expected"),
    [(None, False, False), (None, True, True), ("AUTO", True, True), ("true", False, True), ("false", True, False)],
)
def test_use_ipex_auto_means_only_with_prefix_caching(text: str | None, prefix_caching: bool, expected: bool) -> None:
    parameters = {} if text is None else {"use_ipex": text}
    engine_json = {"model": "m", "enable_prefix_caching": prefix_caching}
    assert settings(parameters, engine_json).use_ipex is expected


@pytest.mark.parametrize(
    ("text", "in_process", "required"),
    [(None, True, False), ("", True, False), (" Auto ", True, False), ("true", True, True), ("off", False, False)],
)
def test_engine_process_defaults_to_auto_and_only_true_requires_it(
    text: str | None, in_process: bool, required: bool
) -> None:
    read = settings({} if text is None else {"engine_process": text})
    assert (read.engine_process, read.engine_process_required) == (in_process, required)


@pytest.mark.parametrize(("text", "cpus"), [(None, ()), (" ", ()), ("1", (1,)), ("0,2-3", (0, 2, 3))])
def test_engine_cpus_is_a_cpu_list_that_requires_the_engine_process(text: str | None, cpus: tuple[int, ...]) -> None:
    read = settings({} if text is None else {"engine_cpus": text})
    assert read.engine_cpus == cpus and read.engine_process
    # Placing the engine needs its process: auto becomes a requirement (a load error without one).
    assert read.engine_process_required == bool(cpus)


@pytest.mark.parametrize(
    ("text", "cpus"), [("last 1", (7,)), (" LAST  2 ", (6, 7)), ("last 4", (0, 2, 6, 7)), ("2-3", (2, 3))]
)
def test_engine_cpus_last_n_takes_the_last_cpus_the_server_runs_on(text: str, cpus: tuple[int, ...]) -> None:
    assert backend.engine_cpus_setting({"engine_cpus": text}, allowed=(7, 0, 6, 2)) == cpus


def test_engine_cpus_last_n_reads_this_process_affinity() -> None:
    assert settings({"engine_cpus": "last 1"}).engine_cpus == (max(os.sched_getaffinity(0)),)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_drain_time_means_derived_from_the_exit_timeout(value: str) -> None:
    assert settings({"unload_drain_seconds": value}).unload_drain_seconds is None


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"stream_mode": "token"}, "parameter 'stream_mode' must be one of step, window, merge, got 'token'"),
        ({"stream_interval": "0"}, "parameter 'stream_interval' must be >= 1, got 0"),
        ({"stream_interval": "2000"}, "parameter 'stream_interval' must be <= 1024, got 2000"),
        ({"enable_metrics": "sometimes"}, "parameter 'enable_metrics' must be true or false, got 'sometimes'"),
        ({"unload_on_engine_failure": "2"}, "parameter 'unload_on_engine_failure' must be true or false"),
        ({"use_ipex": "sometimes"}, "parameter 'use_ipex' must be true, false or auto, got 'sometimes'"),
        ({"engine_process": "maybe"}, "parameter 'engine_process' must be true, false or auto, got 'maybe'"),
        ({"engine_cpus": "1-x"}, '\'1-x\' is not a CPU list such as "1", "2-7" or "0,2-3", or \'last N\''),
        ({"engine_cpus": "last"}, "parameter 'engine_cpus' must be a CPU list or 'last N', got 'last'"),
        ({"engine_cpus": "last two"}, "parameter 'engine_cpus' must be an integer, got 'two'"),
        ({"engine_cpus": "last 0"}, "parameter 'engine_cpus' must be >= 1, got 0"),
        ({"engine_cpus": "last 4096"}, "asks for the last 4096 CPUs, but this server runs on"),
        ({"engine_cpus": "3-1"}, "parameter 'engine_cpus': '3-1' is not a CPU list: '3-1' is not a range"),
        (
            {"engine_cpus": "1", "engine_process": "false"},
            "'engine_cpus' ('1') places the engine process, but 'engine_process' is false",
        ),
        ({"max_n": "many"}, "parameter 'max_n' must be an integer, got 'many'"),
        ({"max_n": "0"}, "parameter 'max_n' must be >= 1, got 0"),
        ({"max_request_bytes": "0"}, "parameter 'max_request_bytes' must be >= 1"),
        ({"max_prompt_tokens": "-1"}, "parameter 'max_prompt_tokens' must be >= 0, got -1"),
        ({"max_tokens_limit": "1.5"}, "parameter 'max_tokens_limit' must be an integer"),
        ({"cpu_kvcache_space_gib": "0"}, "parameter 'cpu_kvcache_space_gib' must be >= 1"),
        ({"unload_drain_seconds": "soon"}, "parameter 'unload_drain_seconds' must be a number of seconds"),
        ({"unload_drain_seconds": "-1"}, "parameter 'unload_drain_seconds' must be a finite number >= 0"),
        ({"unload_drain_seconds": "inf"}, "parameter 'unload_drain_seconds' must be a finite number >= 0"),
        ({"unload_drain_seconds": "nan"}, "parameter 'unload_drain_seconds' must be a finite number >= 0"),
    ],
)
def test_a_bad_parameter_is_a_load_error_naming_it(parameters: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings(parameters)
    assert message in str(caught.value)


def test_parameter_values_of_a_model_config() -> None:
    assert parameters.parameter_values({}) == {}
    assert parameters.parameter_values({"parameters": {"a": {"string_value": "1"}, "b": {}}}) == {"a": "1", "b": ""}


def test_model_json_in_the_version_folder_or_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text(json.dumps({"model": "outer"}))
    assert model_json.load_engine_json(tmp_path, 1) == {"model": "outer"}
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(json.dumps({"model": "inner", "num_scheduler_steps": 4}))
    assert model_json.load_engine_json(tmp_path, "1") == {"model": "inner", "num_scheduler_steps": 4}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "1/model.json is missing: it holds the vLLM engine arguments"),
        ("{model", "model.json is not valid JSON"),
        ("[1]", "model.json must hold a JSON object of vLLM engine arguments"),
        ('{"num_scheduler_steps": 8}', "model.json must name the model"),
    ],
)
def test_a_bad_model_json_is_a_load_error_naming_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "1").mkdir()
        (tmp_path / "1" / "model.json").write_text(content)
    with pytest.raises(ConfigError) as caught:
        model_json.load_engine_json(tmp_path, 1)
    assert message in str(caught.value) and str(tmp_path) in str(caught.value)


def test_model_references_resolve(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    assert model_json.resolve_path("weights", tmp_path) == str((tmp_path / "weights").resolve())
    assert model_json.resolve_path("/abs/path", tmp_path) == "/abs/path"
    assert model_json.resolve_path("org/some-model", tmp_path) == "org/some-model"  # a Hugging Face id
    assert model_json.resolve_path("demo://tiny-llama-bpe", tmp_path) == str(demo_models.build("tiny-llama-bpe"))


@pytest.mark.parametrize(
    ("engine_json", "expected"),
    [
        ({}, 1),
        ({"tensor_parallel_size": 2}, 2),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
        ({"tensor_parallel_size": True}, 1),  # not an int: EngineArgs refuses it later, in vLLM's words
        ({"tensor_parallel_size": "2"}, 1),
        ({"tensor_parallel_size": 0}, 1),
    ],
)
def test_parallel_size_is_read_from_model_json_before_engine_args(engine_json: dict, expected: int) -> None:
    """The instance's device environment (KIND_GPU: one GPU, refused with TP > 1) is set from this,
    before the engine process starts and before EngineArgs checks the values."""
    assert model_json.parallel_size(engine_json) == expected


def test_the_engine_is_multistep_unless_v1_is_chosen_and_v1_gets_no_multistep_default(tmp_path: Path) -> None:
    assert settings({}).vllm_engine == "multistep"
    assert settings({"vllm_engine": " V1 "}).vllm_engine == "v1"
    assert not settings(
        {"vllm_engine": "v1", "use_ipex": "auto"}, {"model": "m", "enable_prefix_caching": True}
    ).use_ipex
    engine = {"model": "/models/m"}
    assert model_json.engine_values(engine, tmp_path, "step", "v1") == {"model": "/models/m"}
    steps = model_json.engine_values(engine, tmp_path, "step")
    assert steps["num_scheduler_steps"] == 8 and steps["multi_step_stream_outputs"] is True


@pytest.mark.parametrize(
    ("parameters", "engine", "message"),
    [
        ({"vllm_engine": "v2"}, {}, "'vllm_engine' must be one of multistep, v1, got 'v2'"),
        ({}, {"num_scheduler_steps": 8}, "'vllm_engine'='v1' and model.json 'num_scheduler_steps'=8 disagree"),
        ({}, {"multi_step_stream_outputs": False}, "model.json 'multi_step_stream_outputs'=false disagree"),
        ({"stream_mode": "window"}, {}, "'vllm_engine'='v1' and 'stream_mode'='window' disagree"),
        ({"engine_process": "false"}, {}, "'vllm_engine'='v1' and 'engine_process'='false' disagree"),
        ({"use_ipex": "true"}, {}, "'vllm_engine'='v1' and 'use_ipex'='true' disagree"),
    ],
)
def test_multistep_settings_on_a_v1_model_are_a_load_error_naming_both(
    parameters: dict[str, str], engine: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings({"vllm_engine": "v1", **parameters}, {"model": "m", **engine})
