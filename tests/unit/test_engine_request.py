"""Both sides of the EngineRequest (engine/events.py): the stub's codec turns a request's sampling
fields into plain JSON values, and the engine (engine/admission.py) builds from them the very
SamplingParams the codec built to check them; the adapter and the images cross as plain values too.
And the engine's side of the outputs: vLLM's RequestOutputs become the plain EngineOutputs the stub
reads (engine/outputs.py), copied where vLLM keeps changing its own.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sequence import Logprob, RequestMetrics

from triton_vllm_multistep.engine import admission
from triton_vllm_multistep.engine.events import Completion, EngineOutput, EngineRequest, TokenLogprob
from triton_vllm_multistep.engine.outputs import plain_outputs
from triton_vllm_multistep.settings.backend import Limits
from triton_vllm_multistep.settings.lora import Adapter
from triton_vllm_multistep.stub import codec

MODEL = codec.ModelLimits(vocab_size=100, max_model_len=64)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

FIELD_SETS: list[dict[str, Any]] = [
    {},
    {"temperature": "0.5", "top_p": 0.9, "top_k": 3.0, "min_p": 0.1, "max_tokens": "7", "min_tokens": 2},
    {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "ignore_eos": "true"},
    {"seed": 0},
    {"seed": 2**63 - 1, "temperature": 1.0},
    {"stop": "x"},
    {"stop": ["a", "bc"], "include_stop_str_in_output": True, "stop_token_ids": [5, "6"]},
    {"logit_bias": {"5": 1.5, "7": -100}},
    {"allowed_token_ids": [1, 2, 3], "bad_words": ["no", "never"]},
    {"n": 2},
    {"n": 2, "best_of": 4},
    {"best_of": 3},
    {"logprobs": True, "prompt_logprobs": 2},
    {"logprobs": 5, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    {"truncate_prompt_tokens": 4},
    {"guided_decoding": {"choice": ["yes", "no"]}},
    {"guided_decoding": json.dumps({"regex": "[a-c]{3}", "backend": "xgrammar"})},
    {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
    {"structured_outputs": {"json": json.dumps(SCHEMA), "backend": "outlines"}},
    {"guided_decoding": {"grammar": 'root ::= "x"', "backend": "guidance"}, "seed": 7},
    {"guided_decoding": {"json_object": True}, "max_tokens": 5},
    {"guided_decoding": {"structural_tag": '{"structures": []}', "backend": "xgrammar:disable-any-whitespace"}},
]


def _request(fields: dict[str, Any], stream: bool, model: codec.ModelLimits = MODEL) -> codec.GenerationRequest:
    inputs = {
        "input_ids": np.array([1, 2, 3], dtype=np.int32),
        "stream": np.array([stream]),
        "sampling_parameters": np.array([json.dumps(fields).encode()], dtype=np.object_),
    }
    return codec.decode_request(inputs, None, model, encode=lambda text: [1], decode=lambda ids: "x")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields", FIELD_SETS, ids=[json.dumps(f)[:60] for f in FIELD_SETS])
def test_the_engine_builds_the_sampling_params_the_codec_checked_from_json_values(
    fields: dict[str, Any], stream: bool
) -> None:
    if stream and "best_of" in fields:
        with pytest.raises(codec.RequestError, match="best_of must equal n to use output_kind=DELTA"):
            _request(fields, stream)  # vLLM's rule, checked by the stub
        return
    generation = _request(fields, stream)
    sampling = codec.engine_request(generation, "r").sampling
    assert json.loads(json.dumps(sampling)) == sampling  # JSON values only
    built = admission.sampling_params(json.loads(json.dumps(sampling)))
    assert built == generation.sampling_params
    assert (built._real_n, built.n, built.best_of) == (
        generation.sampling_params._real_n,
        generation.sampling_params.n,
        generation.sampling_params.best_of,
    )
    assert built.guided_decoding == generation.sampling_params.guided_decoding
    assert sampling["output_kind"] == ("DELTA" if stream else "FINAL_ONLY")


def test_the_limits_defaults_reach_the_engine_too() -> None:
    limited = codec.ModelLimits(100, 64, Limits(max_tokens=8))
    generation = _request({}, stream=True, model=limited)
    assert generation.sampling["max_tokens"] == 8
    assert admission.sampling_params(generation.sampling).max_tokens == 8


def test_the_engine_request_carries_ids_adapter_and_image_files_as_plain_values() -> None:
    generation = _request({"temperature": 0.0}, stream=True)
    generation.adapter = Adapter("alpha", 2, "/adapters/alpha")
    generation.images = (b"\x89PNG...",)
    request = codec.engine_request(generation, "engine-id")
    assert request == EngineRequest(
        "engine-id",
        (1, 2, 3),
        generation.sampling,
        ("alpha", 2, "/adapters/alpha"),
        (b"\x89PNG...",),
    )
    lora = admission.lora_request(request.adapter)
    assert isinstance(lora, LoRARequest)
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("alpha", 2, "/adapters/alpha")
    assert admission.lora_request(None) is None
    assert codec.engine_request(_request({}, stream=False), "x").adapter is None


def _vllm_output(delta: bool) -> RequestOutput:
    logprobs = [{7: Logprob(-0.5, 1, "a"), 3: Logprob(-2.0, 2, "b")}, {8: Logprob(-1.0, 1, "c")}]
    completions = [
        CompletionOutput(0, " world", [7, 8], -1.5, logprobs, None),
        CompletionOutput(1, "!", (9,), None, None, "stop", "\n"),
    ]
    metrics = RequestMetrics(
        arrival_time=1.0, last_token_time=3.0, first_scheduled_time=1.5, first_token_time=2.0, time_in_queue=0.5
    )
    prompt = None if delta else [1, 2, 3, 4]
    return RequestOutput("r", None, prompt, None, completions, finished=False, metrics=metrics)


def test_vllms_outputs_become_the_plain_values_the_stub_reads() -> None:
    (plain,) = plain_outputs([_vllm_output(delta=False)])
    assert plain == EngineOutput(
        "r",
        [
            Completion(
                0,
                " world",
                [7, 8],
                -1.5,
                [{7: TokenLogprob(-0.5, 1, "a"), 3: TokenLogprob(-2.0, 2, "b")}, {8: TokenLogprob(-1.0, 1, "c")}],
                None,
                None,
            ),
            Completion(1, "!", [9], None, None, "stop", "\n"),
        ],
        False,
        prompt_tokens=4,
        first_token_time=2.0,
    )
    (later,) = plain_outputs([_vllm_output(delta=True)])
    assert later.prompt_tokens is None  # a delta after the first: no prompt
    without_metrics = _vllm_output(delta=True)
    without_metrics.metrics = None
    assert plain_outputs([without_metrics])[0].first_token_time is None


def test_the_plain_outputs_are_copies_vllm_can_go_on_changing() -> None:
    output = _vllm_output(delta=False)
    (plain,) = plain_outputs([output])
    output.outputs[0].token_ids.append(99)  # a cumulative output's lists grow with later steps
    output.outputs[0].logprobs.append({99: Logprob(-3.0)})
    assert plain.outputs[0].token_ids == [7, 8] and len(plain.outputs[0].logprobs) == 2
    assert all(type(c.token_ids) is list for c in plain.outputs)


def test_plain_outputs_hold_only_builtin_values_and_the_boundary_types() -> None:
    def leaves(value: Any) -> list[Any]:
        if isinstance(value, dict):
            return [leaf for key, item in value.items() for leaf in (*leaves(key), *leaves(item))]
        if isinstance(value, list | tuple):
            return [value, *(leaf for item in value for leaf in leaves(item))]
        return [value]

    for value in leaves(plain_outputs([_vllm_output(delta=False), _vllm_output(delta=True)])):
        assert type(value).__module__ in ("builtins", "triton_vllm_multistep.engine.events"), type(value)
