"""A model repository written as Triton's vLLM backend documents it, served by this backend.

Their model.json fields (AsyncEngineArgs), their config.pbtxt (instance_group KIND_MODEL, the
REPORT_CUSTOM_METRICS parameter) with only the backend name and the model changed, checked
through a real tritonserver of this module's own (explicit model control, models loaded and
unloaded by the tests): loading, their metrics test, metrics switches, request parameters,
error texts, the image input, settings that disagree, and readiness after an engine failure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from private_servers import metric, model_ready, scrape, wait_for
from triton_clients import grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.testing.faults import server_environment
from triton_vllm_multistep.testing.local_server import ServerProcess, start_ready_server

THEIRS = "vllm_opt"  # their sample model's name
# Their sample model.json, with the demo model for facebook/opt-125m (no hub here).
THEIR_SAMPLE_MODEL_JSON = {
    "model": "demo://tiny-llama-bpe",
    "disable_log_requests": True,
    "gpu_memory_utilization": 0.5,
    "enforce_eager": True,
}
# On CPU a dtype is needed: vLLM's "auto" makes float16 of the float32 demo model, which vLLM's
# CPU kernels lack (their backend runs on GPUs only, where "auto" is fine).
THEIR_MODEL_JSON = {**THEIR_SAMPLE_MODEL_JSON, "dtype": "float32"}
# Their sample config.pbtxt with this backend's name, plus their metrics parameter.
THEIR_CONFIG = """backend: "vllm_multistep"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""
REPORT = 'parameters: {{ key: "REPORT_CUSTOM_METRICS" value: {{ string_value: "{}" }} }}\n'


def write_model(repository: Path, name: str, engine: dict, config_text: str) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config_text)
    (repository / name / "1" / "model.json").write_text(json.dumps(engine))


ENGINE_CPUS = 'parameters: {{ key: "engine_cpus" value: {{ string_value: "{}" }} }}\n'
IN_STUB = 'parameters: { key: "engine_process" value: { string_value: "false" } }\n'
MODELS = {
    THEIRS: (THEIR_MODEL_JSON, THEIR_CONFIG + REPORT.format("true")),
    "metrics_false": (THEIR_MODEL_JSON, THEIR_CONFIG + REPORT.format("false")),
    "metrics_no_stats": ({**THEIR_MODEL_JSON, "disable_log_stats": True}, THEIR_CONFIG + REPORT.format("true")),
    "two_instances": (THEIR_MODEL_JSON, THEIR_CONFIG.replace("count: 1", "count: 2") + REPORT.format("true")),
    "stays_loaded": (
        THEIR_MODEL_JSON,
        THEIR_CONFIG + 'parameters: { key: "unload_on_engine_failure" value: { string_value: "false" } }\n',
    ),
    # Settings that disagree: load errors naming both.
    "stream_conflict": (
        {**THEIR_MODEL_JSON, "multi_step_stream_outputs": False},
        THEIR_CONFIG + 'parameters: { key: "stream_mode" value: { string_value: "step" } }\n',
    ),
    "switch_conflict": (
        THEIR_MODEL_JSON,
        THEIR_CONFIG
        + REPORT.format("false")
        + 'parameters: { key: "enable_metrics" value: { string_value: "true" } }\n',
    ),
    "unknown_field": ({**THEIR_MODEL_JSON, "disable_log_requestz": True}, THEIR_CONFIG),
    "cpus_in_stub": (THEIR_MODEL_JSON, THEIR_CONFIG + ENGINE_CPUS.format("0") + IN_STUB),
    "cpus_two_instances": (THEIR_MODEL_JSON, THEIR_CONFIG.replace("count: 1", "count: 2") + ENGINE_CPUS.format("0")),
    "cpus_absent": (THEIR_MODEL_JSON, THEIR_CONFIG + ENGINE_CPUS.format("4095")),
    "sample_on_cpu": (THEIR_SAMPLE_MODEL_JSON, THEIR_CONFIG),
}
GREEDY_16 = {"temperature": 0, "ignore_eos": True}  # their tests' default max_tokens (16)


@pytest.fixture(scope="module")
def compat_server(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("vllm-backend-compat")
    repository = root / "repository"
    for name, (engine, config_text) in MODELS.items():
        write_model(repository, name, engine, config_text)
    fault_file = root / "engine-fault"
    # start_ready_server starts again on other ports when one was taken meanwhile (seen once).
    handle, _ = start_ready_server(
        repository,
        root / "tritonserver.log",
        "--model-control-mode=explicit",
        f"--load-model={THEIRS}",
        env=server_environment(fault_file),
        timeout=600,
    )
    handle.fault_file = fault_file  # type: ignore[attr-defined]
    try:
        yield handle
    finally:
        handle.stop()


def control(server: ServerProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def load(server: ServerProcess, model: str) -> None:
    client = control(server)
    try:
        client.load_model(model)
    finally:
        client.close()


def unload(server: ServerProcess, model: str) -> None:
    client = control(server)
    try:
        client.unload_model(model)
    finally:
        client.close()
    assert wait_for(lambda: not model_ready(server, model), timeout=120)


def vllm_lines(text: str, model: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("vllm:") and f'model="{model}"' in line]


def value(text: str, name: str, model: str = THEIRS, **labels: str) -> float:
    found = metric(text, name, model, version="1", **labels)
    return 0.0 if found is None else found


def test_their_repository_loads_and_serves(compat_server) -> None:
    assert model_ready(compat_server, THEIRS)
    assert "model.json field 'disable_log_requests' is ignored" in compat_server.log_tail(400)
    result = grpc_generate(compat_server.grpc_url, THEIRS, prompt="Hello, my name is", sampling=GREEDY_16)
    assert result.error is None and result.finals == 1
    # Not streamed, exclude_input_in_output left out: the prompt comes back first, as theirs.
    assert result.text().startswith("Hello, my name is") and len(result.token_ids()) == 16


def test_the_image_input_is_declared_like_theirs_and_refused_for_a_text_only_model(compat_server) -> None:
    metadata = requests.get(f"{compat_server.http_url}/v2/models/{THEIRS}/config", timeout=10).json()
    image = next(item for item in metadata["input"] if item["name"] == "image")
    assert image["data_type"] == "TYPE_STRING" and image["dims"] == [-1] and image["optional"]
    item = grpcclient.InferInput("image", [1], "BYTES")
    item.set_data_from_numpy(np.array([b"aGVsbG8="], dtype=np.object_))
    inputs = [*make_inputs(grpcclient, prompt="<image> describe"), item]
    result = grpc_generate(compat_server.grpc_url, THEIRS, inputs=inputs)
    assert result.finals == 1 and result.error is not None
    assert "input 'image'" in result.error and "is not a multimodal model" in result.error


def test_their_metrics_test_counts_the_same_and_each_final_is_already_counted(compat_server) -> None:
    """Their test: 3 prompts, not streamed, greedy, 16 tokens each: 48 generated, TPOT count 45."""
    before = scrape(compat_server)
    prompts = ["San Francisco is a", "Facebook AI Research is", "The future of AI is"]
    prompt_tokens = 0
    for count, prompt in enumerate(prompts, start=1):
        result = grpc_generate(
            compat_server.grpc_url, THEIRS, prompt=prompt, sampling=GREEDY_16, return_num_input_tokens=True
        )
        assert result.error is None and len(result.token_ids()) == 16
        prompt_tokens += int(result.data_responses[-1]["num_input_tokens"][0])
        # Scraped as soon as the FINAL is in: this request is counted already (no waiting).
        now = scrape(compat_server)
        assert (
            value(now, "vllm:e2e_request_latency_seconds_count")
            - value(before, "vllm:e2e_request_latency_seconds_count")
            == count
        )
        assert value(now, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") == 16 * count
    after = scrape(compat_server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == 48
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:time_per_output_token_seconds_count") == 45
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 48
    assert delta("vllm:request_params_n_count") == 3
    # Their dashboards select on exactly these labels.
    for line in vllm_lines(after, THEIRS):
        if line.startswith("vllm:cache_config_info{"):
            continue  # an info gauge: vLLM's cache config is its labels (router metrics, docs/metrics.md)
        labels = set(re.findall(r'(\w+)="', line))
        assert labels in ({"model", "version"}, {"model", "version", "le"}), line


def test_n_and_best_of_are_reported_and_every_candidate_counts_as_generated(compat_server) -> None:
    before = scrape(compat_server)
    # vLLM refuses n > 1 with greedy sampling: sampled, seeded.
    sampling = {"n": 2, "best_of": 4, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    result = grpc_generate(compat_server.grpc_url, THEIRS, prompt="Once upon a time", sampling=sampling)
    assert result.error is None and len(result.data_responses[-1]["text_output"]) == 2
    after = scrape(compat_server)
    assert value(after, "vllm:request_params_n_count") - value(before, "vllm:request_params_n_count") == 1
    assert value(after, "vllm:request_params_n_sum") - value(before, "vllm:request_params_n_sum") == 2
    assert value(after, "vllm:request_params_n_bucket", le="2") - value(before, "vllm:request_params_n_bucket", le="2")
    # vLLM counts all 4 candidates' tokens (16 each), not only the 2 returned.
    assert value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") == 64


def test_request_parameters_beside_the_sampling_parameters_input_are_ignored_as_theirs(compat_server) -> None:
    inputs = make_inputs(grpcclient, prompt="hello", sampling={"temperature": 0, "max_tokens": 3, "ignore_eos": True})
    result = grpc_generate(
        compat_server.grpc_url, THEIRS, inputs=inputs, parameters={"max_tokenz": 5, "temperature": "hot"}
    )
    assert result.error is None and len(result.token_ids()) == 3
    # Without the input, request parameters are the sampling fields, and errors name them so.
    alone = grpc_generate(
        compat_server.grpc_url, THEIRS, inputs=make_inputs(grpcclient, prompt="x"), parameters={"max_tokenz": 5}
    )
    assert alone.error is not None and "parameters.max_tokenz is not a known vLLM sampling parameter" in alone.error
    assert "sampling_parameters.max_tokenz" not in alone.error


def test_streaming_with_the_prompt_is_refused_with_their_whole_message_and_the_advice_logged(compat_server) -> None:
    """Their CI compares this error text whole: it is theirs exactly; what to do is in the server log."""
    result = grpc_generate(
        compat_server.grpc_url, THEIRS, prompt="hi", stream=True, exclude_input_in_output=False, sampling=GREEDY_16
    )
    assert result.finals == 1 and result.error is not None
    their_text = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    assert result.error.split("] ", 1)[-1] == their_text, result.error
    assert wait_for(lambda: "leave it out when 'stream' is true" in compat_server.log_path.read_text(), timeout=10)


@pytest.mark.parametrize(("model", "why"), [("metrics_false", "REPORT_CUSTOM_METRICS false"), ("metrics_no_stats", "")])
def test_metrics_are_off_as_in_their_backend(compat_server, model: str, why: str) -> None:
    load(compat_server, model)
    try:
        result = grpc_generate(compat_server.grpc_url, model, prompt="hi", sampling={**GREEDY_16, "max_tokens": 2})
        assert result.error is None
        assert vllm_lines(scrape(compat_server), model) == [], why
    finally:
        unload(compat_server, model)
    if model == "metrics_no_stats":
        assert "'disable_log_stats': true wins over config.pbtxt parameter REPORT_CUSTOM_METRICS=true" in (
            compat_server.log_tail(2000)
        )


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ("stream_conflict", ("'stream_mode'='step'", "'multi_step_stream_outputs'=false")),
        ("switch_conflict", ("'enable_metrics'='true'", "'REPORT_CUSTOM_METRICS'='false'")),
        ("unknown_field", ("unknown vLLM engine argument(s): disable_log_requestz",)),
        ("cpus_in_stub", ("'engine_cpus' ('0') places the engine process", "'engine_process' is false")),
        ("cpus_two_instances", ("engine_cpus places one engine", "instance_group runs 2 instances")),
        ("cpus_absent", ("engine_cpus 4095 names CPUs this server may not run on", "CPUs it runs on now")),
        # Not a disagreement, but the same kind of load error: their sample as is, on a CPU host.
        ("sample_on_cpu", ("'dtype' ('auto') resolves to float16", 'set "dtype": "float32"')),
    ],
)
def test_settings_that_disagree_or_are_unknown_fail_the_load_naming_them(compat_server, model, named) -> None:
    with pytest.raises(InferenceServerException) as raised:
        load(compat_server, model)
    for text in named:
        assert text in str(raised.value), str(raised.value)
    assert not model_ready(compat_server, model)


def test_two_instances_add_up_on_one_series_with_their_labels(compat_server) -> None:
    single = scrape(compat_server)
    blocks_one = value(single, "vllm_multistep:kv_cache_total_blocks")
    load(compat_server, "two_instances")
    try:
        for index in range(4):
            result = grpc_generate(
                compat_server.grpc_url, "two_instances", prompt=f"hi {index}", sampling={**GREEDY_16, "max_tokens": 3}
            )
            assert result.error is None
        text = scrape(compat_server)
        assert value(text, "vllm_multistep:engine_alive", "two_instances") == 2
        assert value(text, "vllm_multistep:kv_cache_total_blocks", "two_instances") == 2 * blocks_one > 0
        assert value(text, "vllm:generation_tokens_total", "two_instances") == 4 * 3
        assert value(text, "vllm:gpu_cache_usage_perc", "two_instances") == pytest.approx(0.0, abs=1e-9)
    finally:
        unload(compat_server, "two_instances")
    # Not ready comes at the unload's start; each instance takes its share out as it finalizes. The
    # series stay: tritonserver 2.51 frees a series two stubs hold under the second one when the
    # first deletes it (docs/lifecycle.md), so a multi-instance model leaves them at 0.
    assert wait_for(
        lambda: value(scrape(compat_server), "vllm_multistep:engine_alive", "two_instances") == 0, timeout=120
    ), "the instances did not take their share out"
    text = scrape(compat_server)
    assert value(text, "vllm:num_requests_running", "two_instances") == 0
    assert value(text, "vllm_multistep:kv_cache_total_blocks", "two_instances") == 0
    assert value(text, "vllm:generation_tokens_total", "two_instances") == 4 * 3  # counters keep their totals


def test_after_an_engine_failure_the_model_is_taken_out_of_service(compat_server) -> None:
    """Runs last: it ends the engine of the model the tests above use."""
    server = compat_server
    load(server, "stays_loaded")
    fault_file: Path = server.fault_file  # type: ignore[attr-defined]
    fault_file.touch()
    try:
        failed = grpc_generate(server.grpc_url, THEIRS, prompt="hi", sampling={**GREEDY_16, "max_tokens": 50})
        assert failed.error is not None and "vLLM engine failed" in failed.error
        # The unload is asked once the errors are out (see ModelServer._after_engine_death_answered).
        assert wait_for(lambda: not model_ready(server, THEIRS), timeout=30)
        # A model that stays loaded refuses with their backend's phrase first.
        lost = grpc_generate(server.grpc_url, "stays_loaded", prompt="hi", sampling={**GREEDY_16, "max_tokens": 50})
        assert lost.error is not None and "vLLM engine failed" in lost.error
        refused = grpc_generate(server.grpc_url, "stays_loaded", prompt="hi", sampling=GREEDY_16)
        assert refused.error is not None
        # Their text whole (their CI compares it whole); the engine's error is in the server log.
        assert refused.error.split("] ", 1)[-1] == "Model is unavailable due to unhealthy vLLM engine", refused.error
        assert re.search(r"model stays_loaded: engine failed \(.*InjectedEngineFault", server.log_path.read_text())
    finally:
        fault_file.unlink(missing_ok=True)
