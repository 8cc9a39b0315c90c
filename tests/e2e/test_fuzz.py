"""Limits, security and property-based fuzzing through a real tritonserver of this module's own.

The model here is configured with small limits (config.pbtxt parameters) and metrics off.
Hypothesis generates `sampling_parameters` JSON and whole input tensor sets (names, types,
shapes, sizes, encodings): every request must end with exactly one FINAL, as a success that
respects the limits or as a clear error, and the server must stay ready.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from private_servers import make_repository, metric, model_ready, scrape
from triton_clients import StreamResult, grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.testing.local_server import ServerProcess, start_ready_server

MODEL = "vllm_model_limited"
LIMITS = {"max_prompt_tokens": 32, "max_tokens_limit": 16, "max_n": 2, "max_request_bytes": 4096}
ADMIN_HEADER, ADMIN_KEY = "admin-key", "s3cret"
ERROR_SMELLS = ("Traceback", "NoneType", "internal error", "object has no attribute", "Stub process")


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("limits")
    parameters = {key: str(value) for key, value in LIMITS.items()} | {"enable_metrics": "false"}
    repository = make_repository(root, {MODEL: {"parameters": parameters}})
    handle, _ = start_ready_server(  # started again on other ports if one was taken meanwhile
        repository,
        root / "tritonserver.log",
        f"--grpc-restricted-protocol=model-repository,shared-memory:{ADMIN_HEADER}={ADMIN_KEY}",
        f"--http-restricted-api=model-repository,shared-memory:{ADMIN_HEADER}={ADMIN_KEY}",
        timeout=600,
    )
    try:
        yield handle
    finally:
        handle.stop()


def generate(server: ServerProcess, **kwargs) -> StreamResult:
    return grpc_generate(server.grpc_url, MODEL, timeout=60, settle=0.05, **kwargs)


def assert_clear_error(result: StreamResult, fragment: str = "") -> None:
    assert result.finals == 1, (result.finals, result.error)
    assert result.error, "expected an error"
    assert fragment in result.error, result.error
    assert not any(smell in result.error for smell in ERROR_SMELLS), result.error


def assert_well_ended(server: ServerProcess, result: StreamResult) -> None:
    """Exactly one FINAL; a success within the limits or a clear error."""
    assert result.finals == 1, (result.finals, result.error)
    if result.error is not None:
        assert result.error.strip() and not any(smell in result.error for smell in ERROR_SMELLS), result.error
    else:
        for response in result.data_responses:
            assert len(response["output_ids"]) <= LIMITS["max_tokens_limit"] * LIMITS["max_n"]
    assert server.is_ready()


GOOD = {"temperature": 0, "ignore_eos": True}


def test_requests_within_the_configured_limits_are_served(limited_server) -> None:
    at_limit = generate(
        limited_server,
        input_ids=[1] + [7] * (LIMITS["max_prompt_tokens"] - 1),
        sampling={**GOOD, "temperature": 1.0, "max_tokens": LIMITS["max_tokens_limit"], "n": LIMITS["max_n"]},
        stream=True,
        return_num_output_tokens=True,
    )
    assert at_limit.error is None and at_limit.finals == 1
    counts = np.sum([r["num_output_tokens"] for r in at_limit.data_responses], axis=0)
    assert counts.tolist() == [LIMITS["max_tokens_limit"]] * LIMITS["max_n"]
    # No max_tokens: vLLM's default (16) is capped at the limit too.
    default = generate(limited_server, prompt="hello", sampling={"ignore_eos": True}, stream=True)
    assert default.error is None and len(default.token_ids()) <= LIMITS["max_tokens_limit"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": [1] + [7] * 32}, "the prompt has 33 tokens, more than this model's limit of 32"),
        ({"prompt": "word " * 40}, "more than this model's limit of 32"),
        ({"prompt": "hi", "sampling": {"max_tokens": 17}}, "max_tokens=17 exceeds this model's limit of 16"),
        ({"prompt": "hi", "sampling": {"n": 3}}, "n must be between 1 and 2"),
        ({"prompt": "hi", "sampling": {"best_of": 3}}, "best_of must be between 1 and 2"),
        ({"prompt": "x" * 5000}, "request inputs are 5000 bytes, over this model's limit of 4096"),
        ({"input_ids": list(range(1, 1100))}, "over this model's limit of 4096"),
        ({"prompt": "hi", "sampling": {"stop": ["s" * 5000]}}, "over this model's limit of 4096"),
    ],
    ids=["prompt-ids", "prompt-text", "max_tokens", "n", "best_of", "bytes-text", "bytes-ids", "bytes-sampling"],
)
def test_requests_beyond_the_configured_limits_are_refused(limited_server, kwargs: dict, message: str) -> None:
    assert_clear_error(generate(limited_server, **kwargs), message)
    assert generate(limited_server, prompt="still fine", sampling={**GOOD, "max_tokens": 2}).error is None


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"logits_processors": ["os.system"]}, "logits processors are not supported"),
        ({"lora_name": "/etc/passwd"}, "LoRA feature is not enabled."),
        ({"lora_request": {"lora_path": "/tmp/adapter"}}, "lora_request is not a known vLLM sampling parameter"),
        ({"trust_remote_code": True}, "trust_remote_code is not a known vLLM sampling parameter"),
        ({"tokenizer": "/tmp/evil-tokenizer"}, "tokenizer is not a known vLLM sampling parameter"),
        ({"model": "/tmp/other-model"}, "model is not a known vLLM sampling parameter"),
        ({"guided_decoding": {"json": "/etc/passwd"}}, "guided_decoding.json is not a valid JSON schema"),
        ({"extra_args": {"x": 1}}, "not accepted from requests"),
        ({"output_kind": 2}, "set by the backend"),
    ],
    ids=lambda value: value if isinstance(value, str) else next(iter(value)),
)
def test_nothing_in_a_request_names_files_or_code(limited_server, sampling: dict, message: str) -> None:
    assert_clear_error(generate(limited_server, prompt="hi", sampling=sampling), message)
    # The same through KServe request parameters.
    inputs = make_inputs(grpcclient, prompt="hi")
    as_parameters = {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in sampling.items()}
    result = grpc_generate(limited_server.grpc_url, MODEL, inputs=inputs, parameters=as_parameters, settle=0.05)
    assert result.finals == 1 and result.error, result.error


def test_restricted_model_control_and_shared_memory_endpoints_need_the_header(limited_server) -> None:
    """The README's hardening flags, as passed to this module's server."""
    client = grpcclient.InferenceServerClient(limited_server.grpc_url)
    try:
        for call in (
            lambda **kw: client.unload_model(MODEL, **kw),
            lambda **kw: client.get_model_repository_index(**kw),
            lambda **kw: client.register_system_shared_memory("region", "/some_key", 64, **kw),
        ):
            with pytest.raises(InferenceServerException, match="restricted|header"):
                call()
        # gRPC clients send the key as the header `triton-grpc-protocol-<key>`.
        headers = {f"triton-grpc-protocol-{ADMIN_HEADER}": ADMIN_KEY}
        index = client.get_model_repository_index(headers=headers, as_json=True)
        assert any(model["name"] == MODEL for model in index["models"])
    finally:
        client.close()
    assert model_ready(limited_server, MODEL)


def test_metrics_can_be_switched_off(limited_server) -> None:
    assert generate(limited_server, prompt="hi", sampling={**GOOD, "max_tokens": 2}).error is None
    text = scrape(limited_server)
    assert metric(text, "vllm:num_requests_running", MODEL) is None
    assert metric(text, "vllm:generation_tokens_total", MODEL) is None
    assert "nv_inference_request_success" in text  # Triton's own metrics are still there


# --- property-based fuzzing -------------------------------------------------------------------

FIELD_NAMES = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "truncate_prompt_tokens", "logit_bias", "allowed_token_ids", "bad_words", "logits_processors",
    "guided_decoding", "lora_name", "output_kind", "detokenize", "extra_args",
]  # fmt: skip
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["1", "0.5", "true", "nan", "-1", "1e308", ""])
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
sampling_objects = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=12), json_values, max_size=6).map(
    lambda fields: {**fields, "max_tokens": fields.get("max_tokens", 4)}
)
sampling_texts = st.one_of(
    sampling_objects.map(lambda fields: json.dumps(fields)),  # may hold NaN/Infinity: Python's JSON allows them
    json_values.map(json.dumps),  # not an object
    st.text(max_size=60),  # mostly not JSON at all
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
)
FUZZ_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ_SETTINGS
@given(text=sampling_texts, stream=st.booleans())
def test_fuzzed_sampling_parameters_always_end_cleanly(limited_server, text: str, stream: bool) -> None:
    result = generate(limited_server, prompt="fuzz me", sampling=text, stream=stream)
    assert_well_ended(limited_server, result)


# (Triton datatype, numpy dtype, element strategy) for tensor contents.
TENSOR_TYPES = [
    ("BYTES", np.object_, st.binary(max_size=64)),
    ("BYTES", np.object_, st.text(max_size=32).map(lambda t: t.encode("utf-8"))),
    ("BOOL", np.bool_, st.booleans()),
    ("INT32", np.int32, st.integers(-(2**31), 2**31 - 1)),
    ("INT64", np.int64, st.integers(-(2**63), 2**63 - 1)),
    ("UINT8", np.uint8, st.integers(0, 255)),
    ("FP32", np.float32, st.floats(width=32, allow_nan=True)),
]
INPUT_NAMES = [
    "text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
    "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
    "not_an_input",
]  # fmt: skip


@st.composite
def tensor(draw: st.DrawFn) -> grpcclient.InferInput:
    name = draw(st.sampled_from(INPUT_NAMES))
    triton_type, dtype, elements = draw(st.sampled_from(TENSOR_TYPES))
    if name == "input_ids" and draw(st.booleans()):  # often the right type, to reach the codec
        triton_type, dtype, elements = "INT32", np.int32, st.integers(-5, 700)
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    if name == "input_ids" and draw(st.booleans()):
        shape = [draw(st.integers(0, 1200))]  # long prompts: limits and request size
    count = int(np.prod(shape)) if shape else 1
    values = draw(st.lists(elements, min_size=count, max_size=count)) if count <= 64 else [1] * count
    array = np.array(values, dtype=dtype).reshape(shape)
    item = grpcclient.InferInput(name, list(shape), triton_type)
    item.set_data_from_numpy(array)
    return item


def unique_by_name(items: list[grpcclient.InferInput]) -> list[grpcclient.InferInput]:
    return list({item.name(): item for item in items}.values())


@FUZZ_SETTINGS
@given(inputs=st.lists(tensor(), min_size=0, max_size=5).map(unique_by_name))
def test_fuzzed_input_tensors_always_end_cleanly(limited_server, inputs: list) -> None:
    result = generate(limited_server, inputs=inputs)
    assert_well_ended(limited_server, result)


def test_server_still_serves_after_fuzzing(limited_server) -> None:
    assert model_ready(limited_server, MODEL)
    result = generate(limited_server, prompt="after the storm", sampling={**GOOD, "max_tokens": 5}, stream=True)
    assert result.error is None and len(result.token_ids()) == 5
    assert "Traceback" not in limited_server.log_tail(2000)
