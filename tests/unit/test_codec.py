"""Request codec: Triton input arrays → a validated request (every error names its input or field),
sampling JSON → typed SamplingParams, engine outputs → response arrays.

The end-to-end tier sends the same kinds of bad input through a real server (test_llm_e2e.py,
test_fuzz.py); here each rule is checked on its own, in milliseconds.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from triton_vllm_multistep import interface
from triton_vllm_multistep.engine.events import Completion, EngineOutput, RequestTimes, TokenLogprob
from triton_vllm_multistep.settings import Limits
from triton_vllm_multistep.stub import codec

VOCAB = 100
MODEL = codec.ModelLimits(vocab_size=VOCAB, max_model_len=64)


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one token per character (enough for validation rules)."""
    return [1 + ord(char) % (VOCAB - 1) for char in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(96 + i % 26) for i in ids)


def text(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def boolean(value: bool) -> np.ndarray:
    return np.array([value])


def request(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None = None, model: codec.ModelLimits = MODEL
) -> codec.GenerationRequest:
    return codec.decode_request(inputs, json.dumps(parameters or {}), model, encode, decode)


def sampling(fields: dict[str, Any], **inputs: np.ndarray) -> dict[str, np.ndarray]:
    return {"text_input": text("hello"), "sampling_parameters": text(json.dumps(fields)), **inputs}


def test_a_text_prompt_with_typed_sampling_fields() -> None:
    fields = {
        "temperature": "0.5",  # strings of numbers are accepted, as Triton's vLLM backend does
        "max_tokens": "7",
        "top_k": 3.0,  # a whole float is an integer
        "ignore_eos": "true",
        "stop": "x",  # one string → a list of one
        "stop_token_ids": [5, "6"],
        "logit_bias": {"7": -1},
    }
    generation = request(sampling(fields, stream=boolean(True)))
    params = generation.sampling_params
    assert generation.prompt_token_ids == encode("hello")
    assert generation.stream is True
    assert generation.prepend_prompt is False  # streams never get the prompt back
    assert (params.temperature, params.max_tokens, params.top_k, params.ignore_eos) == (0.5, 7, 3, True)
    assert params.stop == ["x"] and params.stop_token_ids == [5, 6] and params.logit_bias == {7: -1.0}
    assert params.output_kind.name == "DELTA"
    assert request(sampling({})).sampling_params.output_kind.name == "FINAL_ONLY"


def test_the_prompt_is_prepended_only_to_text_prompts_that_are_not_streamed() -> None:
    plain = request({"text_input": text("hello")})
    assert plain.prepend_prompt is True and plain.prompt_text == "hello"
    ids = request({"input_ids": np.array([3, 4, 5], dtype=np.int32)})
    assert ids.prepend_prompt is False and ids.prompt_token_ids == [3, 4, 5]
    asked = request({"input_ids": np.array([3, 4], dtype=np.int32), "exclude_input_in_output": boolean(False)})
    assert asked.prepend_prompt is True and asked.prompt_text == decode([3, 4])


def test_request_parameters_are_sampling_fields_unless_the_input_is_there() -> None:
    parameters = {"temperature": 0.3, "top_p": 0.5, "sequence_id": 9, "triton_enable_empty_final_response": True}
    alone = request({"text_input": text("hi")}, parameters)
    assert (alone.sampling_params.temperature, alone.sampling_params.top_p) == (0.3, 0.5)  # Triton's keys skipped
    # As in Triton's vLLM backend: the sampling_parameters input wins outright, request parameters are ignored.
    generation = request(sampling({"temperature": 0.7}), parameters)
    assert (generation.sampling_params.temperature, generation.sampling_params.top_p) == (0.7, 1.0)


def test_stream_interval_is_read_beside_the_sampling_fields_wherever_they_come_from() -> None:
    assert request({"text_input": text("hi")}, {"stream_interval": 4, "temperature": 0}).stream_interval == 4
    assert request({"text_input": text("hi")}, {"stream_interval": "3"}).stream_interval == 3
    assert request(sampling({"stream_interval": 2, "max_tokens": 5})).stream_interval == 2
    assert request(sampling({"max_tokens": 5})).stream_interval is None
    for bad in (0, 1025, 1.5, True, "often"):
        with pytest.raises(codec.RequestError, match="sampling_parameters.stream_interval must be an integer"):
            request(sampling({"stream_interval": bad}))
    with pytest.raises(codec.RequestError, match=r"^parameters\.stream_interval must be"):
        request({"text_input": text("hi")}, {"stream_interval": -1})


def test_a_configured_max_tokens_limit_also_caps_the_default() -> None:
    limited = codec.ModelLimits(VOCAB, 64, Limits(max_tokens=8))
    assert request({"text_input": text("hi")}, model=limited).sampling_params.max_tokens == 8
    assert request(sampling({"max_tokens": 8}), model=limited).sampling_params.max_tokens == 8


def test_only_the_requested_outputs_are_built() -> None:
    """Triton passes on only the outputs a client (or an ensemble step's output_map) asked for."""
    generation = request(sampling({"n": 2}, return_num_output_tokens=boolean(True), return_finish_reason=boolean(True)))
    completions = [Completion(0, "ab", [1, 2], None, None, "stop"), Completion(1, "c", [3], None, None)]
    everything = codec.encode_response(_output(completions), generation, first=True)
    assert set(everything) == {"text_output", "output_ids", "num_output_tokens", "finish_reason"}
    generation.outputs = frozenset({"text_output", "num_output_tokens", "logprobs"})  # logprobs: not returned
    arrays = codec.encode_response(_output(completions), generation, first=True)
    assert set(arrays) == {"text_output", "num_output_tokens"}
    for name, array in arrays.items():
        assert array.tolist() == everything[name].tolist(), name
    generation.outputs = frozenset({"output_ids"})
    assert set(codec.encode_response(_output(completions), generation, first=False)) == {"output_ids"}


def test_windows_not_requested_still_keep_the_context_for_later_ones() -> None:
    generation = request({"input_ids": np.array([1, 2], dtype=np.int32), "return_detokenization_window": boolean(True)})
    decode = lambda ids, _skip: "".join(chr(96 + i) for i in ids)  # noqa: E731
    generation.outputs = frozenset({"output_ids"})
    arrays = codec.encode_response(_output([Completion(0, "c", [3], None, None)]), generation, True, decode)
    assert set(arrays) == {"output_ids"} and generation.context_ids == [1, 2, 3]
    generation.outputs = None
    arrays = codec.encode_response(_output([Completion(0, "d", [4], None, None)]), generation, False, decode)
    assert generation.context_ids == [1, 2, 3, 4] and arrays["window_ids"].tolist()[-1] == 4


def test_return_flags_are_read_and_windows_keep_the_context() -> None:
    generation = request(
        {
            "input_ids": np.array([1, 2], dtype=np.int32),
            "return_finish_reason": boolean(True),
            "return_detokenization_window": np.array([1], dtype=np.int8),  # 0/1 integers count as BOOL
        }
    )
    assert generation.returns.finish_reason and generation.returns.detokenization_window
    assert not generation.returns.logprobs
    assert generation.context_ids == [1, 2]


@pytest.mark.parametrize(
    ("inputs", "parameters", "model", "message"),
    [
        (
            {"text_input": text("a"), "input_ids": np.array([1], np.int32)},
            None,
            MODEL,
            "exactly one of 'text_input' or 'input_ids' is required, not both",
        ),
        ({"stream": boolean(True)}, None, MODEL, "exactly one of 'text_input' or 'input_ids' is required"),
        ({"text_input": text("")}, None, MODEL, "'text_input' is empty"),
        ({"text_input": text(b"\xff\xfe")}, None, MODEL, "input 'text_input' is not valid UTF-8"),
        ({"text_input": np.array([b"a", b"b"], np.object_)}, None, MODEL, "input 'text_input' must hold exactly one"),
        ({"text_input": np.array([1.5], np.float32)}, None, MODEL, "input 'text_input' must be STRING (BYTES)"),
        ({"input_ids": np.array([1.0], np.float32)}, None, MODEL, "input 'input_ids' must be INT32"),
        ({"input_ids": np.array([], np.int32)}, None, MODEL, "the prompt has no tokens"),
        ({"input_ids": np.array([VOCAB], np.int32)}, None, MODEL, "input 'input_ids': token id 100 is outside"),
        ({"input_ids": np.array([1] * 65, np.int32)}, None, MODEL, "the prompt has 65 tokens, more than this model"),
        (
            {"input_ids": np.array([1] * 5, np.int32)},
            None,
            codec.ModelLimits(VOCAB, 64, Limits(max_prompt_tokens=4)),
            "more than this model's limit of 4",
        ),
        (
            {"text_input": text("x" * 50)},
            None,
            codec.ModelLimits(VOCAB, 64, Limits(max_request_bytes=10)),
            "over this model's limit of 10",
        ),
        ({"text_input": text("a"), "stream": np.array([2], np.int32)}, None, MODEL, "input 'stream' must be BOOL"),
        (
            {"text_input": text("a"), "stream": boolean(True), "exclude_input_in_output": boolean(False)},
            None,
            MODEL,
            "When streaming, `exclude_input_in_output` = False is not allowed",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text("{nope")},
            None,
            MODEL,
            "input 'sampling_parameters' is not valid JSON",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text("[1]")},
            None,
            MODEL,
            "input 'sampling_parameters' must be a JSON object, got an array",
        ),
        ({"text_input": text("a")}, {"bogus": 1}, MODEL, "parameters.bogus is not a known vLLM sampling"),
        (sampling({"guided_decoding": {}}), None, MODEL, "sampling_parameters.guided_decoding needs exactly one of"),
        (sampling({"guided_decoding": "{nope"}), None, MODEL, "sampling_parameters.guided_decoding is not valid JSON"),
        (sampling({"guided_decoding": 3}), None, MODEL, "sampling_parameters.guided_decoding must be a JSON object"),
        (
            sampling({"guided_decoding": {"regex": "a", "choice": ["b"]}}),
            None,
            MODEL,
            "sampling_parameters.guided_decoding needs exactly one of json, regex, choice, grammar, json_object, "
            "structural_tag: got regex and choice",
        ),
        (
            sampling({"guided_decoding": {"regexp": "a"}}),
            None,
            MODEL,
            "sampling_parameters.guided_decoding.regexp is not a field of vLLM's GuidedDecodingParams",
        ),
        (
            sampling({"structured_outputs": {"json": "{oops"}}),
            None,
            MODEL,
            "sampling_parameters.structured_outputs.json is not a valid JSON schema",
        ),
        (
            sampling({"guided_decoding": {"json": [1]}}),
            None,
            MODEL,
            "sampling_parameters.guided_decoding.json must be a JSON schema (an object), got an array",
        ),
        (sampling({"guided_decoding": {"choice": []}}), None, MODEL, "guided_decoding.choice must be a non-empty list"),
        (sampling({"guided_decoding": {"regex": ""}}), None, MODEL, "guided_decoding.regex must be a non-empty string"),
        (sampling({"guided_decoding": {"json_object": 1}}), None, MODEL, "guided_decoding.json_object must be true"),
        (
            sampling({"guided_decoding": {"regex": "a", "backend": "magic"}}),
            None,
            MODEL,
            "sampling_parameters.guided_decoding.backend must be one of auto, xgrammar, outlines",
        ),
        (
            sampling({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}),
            None,
            MODEL,
            "guided_decoding and structured_outputs are two names for one setting",
        ),
        (
            sampling({"guided_decoding": {"regex": "a"}, "n": 2}),
            None,
            MODEL,
            "sampling_parameters.guided_decoding supports one sequence per request",
        ),
        (sampling({"lora_name": "x"}), None, MODEL, "LoRA feature is not enabled."),
        (sampling({"temperature": "hot"}), None, MODEL, "sampling_parameters.temperature: expected a number"),
        (sampling({"temperature": "nan"}), None, MODEL, "sampling_parameters.temperature: must be a finite number"),
        (sampling({"top_k": True}), None, MODEL, "sampling_parameters.top_k: expected an integer, got True"),
        (sampling({"top_k": 1.5}), None, MODEL, "sampling_parameters.top_k: expected an integer, got 1.5"),
        (sampling({"ignore_eos": "maybe"}), None, MODEL, "sampling_parameters.ignore_eos: expected true or false"),
        (sampling({"stop": [1, 2]}), None, MODEL, "sampling_parameters.stop: expected a string or a list of strings"),
        (sampling({"stop_token_ids": 5}), None, MODEL, "sampling_parameters.stop_token_ids: expected a list"),
        (sampling({"stop_token_ids": [1, "x"]}), None, MODEL, "sampling_parameters.stop_token_ids[1]: expected an"),
        (sampling({"stop_token_ids": [VOCAB]}), None, MODEL, "sampling_parameters.stop_token_ids: token id 100"),
        (sampling({"logit_bias": [1]}), None, MODEL, "sampling_parameters.logit_bias: expected an object"),
        (sampling({"logit_bias": {"-1": 1}}), None, MODEL, "sampling_parameters.logit_bias: token id -1"),
        (sampling({"max_tokens": 0}), None, MODEL, "sampling_parameters.max_tokens must be >= 1, got 0"),
        (
            sampling({"max_tokens": 9}),
            None,
            codec.ModelLimits(VOCAB, 64, Limits(max_tokens=8)),
            "sampling_parameters.max_tokens=9 exceeds this model's limit of 8",
        ),
        (sampling({"n": 17}), None, MODEL, "sampling_parameters.n must be between 1 and 16, got 17"),
        (sampling({"best_of": 0}), None, MODEL, "sampling_parameters.best_of must be between 1 and 16"),
        (sampling({"seed": -1}), None, MODEL, "sampling_parameters.seed must be between 0 and"),
        (sampling({"logprobs": 21}), None, MODEL, "sampling_parameters.logprobs must be between 0 and 20"),
        (sampling({"top_p": 1.5}), None, MODEL, "sampling_parameters: top_p must be in (0, 1]"),  # vLLM's check
        (
            sampling({"n": 2}, return_detokenization_window=boolean(True)),
            None,
            MODEL,
            "return_detokenization_window supports one completion per request (n=1)",
        ),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_it(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None, model: codec.ModelLimits, message: str
) -> None:
    with pytest.raises(codec.RequestError) as caught:
        request(inputs, parameters, model)
    assert message in str(caught.value)


def test_a_boolean_logprobs_means_what_vllm_reads_it_as() -> None:
    """Triton's own OpenAI frontend (r24.11-r25.11) sends "logprobs": false with every chat request."""
    assert request(sampling({"logprobs": False})).sampling_params.logprobs == 0
    assert request(sampling({"logprobs": True})).sampling_params.logprobs == 1
    assert request(sampling({"logprobs": 3})).sampling_params.logprobs == 3


def test_empty_sampling_json_means_no_fields() -> None:
    assert codec.parse_sampling_fields(None, "x") == {}
    assert codec.parse_sampling_fields("  ", "x") == {}
    assert codec.parse_sampling_fields('{"n": 1}', "x") == {"n": 1}


def _output(completions: list[Completion], finished: bool = False) -> EngineOutput:
    return EngineOutput("r", completions, finished, prompt_tokens=3)


def test_response_arrays_hold_one_element_per_completion() -> None:
    generation = request(
        sampling(
            {"n": 2},
            return_finish_reason=boolean(True),
            return_cumulative_logprob=boolean(True),
            return_logprobs=boolean(True),
            return_num_input_tokens=boolean(True),
            return_num_output_tokens=boolean(True),
        )
    )
    completions = [
        Completion(
            0, " world", [7, 8], -1.5, [{7: TokenLogprob(-0.5, 1, "a")}, {8: TokenLogprob(-1.0, 2, "b")}], "length"
        ),
        Completion(1, "!", [9], None, None, None),
    ]
    arrays = codec.encode_response(_output(completions, finished=True), generation, first=True)
    assert arrays["text_output"].tolist() == [b"hello world", b"hello!"]  # prompt prepended on the first
    assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].tolist() == [7, 8, 9]
    assert arrays["num_output_tokens"].tolist() == [2, 1] and arrays["num_output_tokens"].dtype == np.uint32
    assert arrays["num_input_tokens"].tolist() == [len("hello")]
    assert arrays["finish_reason"].tolist() == [b"length", b"None"]
    assert arrays["cumulative_logprob"][0] == np.float32(-1.5) and math.isnan(arrays["cumulative_logprob"][1])
    first_logprobs = json.loads(arrays["logprobs"][0])
    assert first_logprobs[1] == {"8": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}}
    assert arrays["logprobs"][1] == b"null"
    later = codec.encode_response(_output(completions), generation, first=False)
    assert later["text_output"].tolist() == [b" world", b"!"]  # only the first response has the prompt


def test_perf_metrics_come_on_the_final_response_only_as_the_engine_timed_them() -> None:
    generation = request(sampling({}, stream=boolean(True), return_perf_metrics=boolean(True)))
    completions = [Completion(0, "ab", [1, 2], None, None)]
    assert set(codec.encode_response(_output(completions), generation, first=True)) == {"text_output", "output_ids"}
    times = RequestTimes(1_700_000_000.25, 1_700_000_000.5, 1_700_000_001.0, None, num_cached_tokens=128)
    final = EngineOutput("r", completions, True, None, None, times)
    arrays = codec.encode_response(final, generation, first=False)
    assert arrays["arrival_time_ns"].dtype == np.int64
    nanoseconds = [arrays[name][0] for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns")]
    assert nanoseconds == [round(seconds * 1e9) for seconds in times[:3]]
    assert arrays["first_token_time_ns"][0] // 1_000_000 == 1_700_000_001_000  # milliseconds exact
    assert arrays["last_token_time_ns"].tolist() == [-1]  # the engine has none
    assert arrays["num_cached_tokens"].dtype == np.uint32 and arrays["num_cached_tokens"].tolist() == [128]
    untimed = codec.encode_response(EngineOutput("r", completions, True), generation, first=False)
    assert [untimed[name].tolist() for name in interface.PERF_METRICS_OUTPUTS] == [[-1]] * 4 + [[0]]
    generation.outputs = frozenset({"text_output", "num_cached_tokens"})
    assert set(codec.encode_response(final, generation, first=False)) == {"text_output", "num_cached_tokens"}
    not_asked = request(sampling({}, stream=boolean(True)))
    assert set(codec.encode_response(final, not_asked, first=False)) == {"text_output", "output_ids"}


def test_optional_outputs_are_sent_only_when_asked() -> None:
    generation = request(sampling({}, stream=boolean(True)))
    arrays = codec.encode_response(_output([Completion(0, "ab", [1, 2], None, None)]), generation, first=True)
    assert set(arrays) == {"text_output", "output_ids"}
    assert arrays["text_output"].tolist() == [b"ab"]


@pytest.mark.parametrize("field", ["guided_decoding", "structured_outputs"])
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"regex": "[a-c]{3}", "backend": "xgrammar"}, {"regex": "[a-c]{3}", "backend": "xgrammar"}),
        ({"json": {"type": "object"}}, {"json": {"type": "object"}}),
        (
            {"json": '{"type": "integer"}', "whitespace_pattern": " "},
            {"json": {"type": "integer"}, "whitespace_pattern": " "},
        ),
        ({"grammar": 'root ::= "x"', "backend": "guidance"}, {"grammar": 'root ::= "x"', "backend": "guidance"}),
        ({"json_object": True}, {"json_object": True}),
    ],
)
def test_structured_output_as_a_json_string_or_an_object_becomes_vllms_guided_decoding(
    field: str, given: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Triton's vLLM backend sends a JSON string (r25.01-r25.10 guided_decoding, r25.11+ structured_outputs)."""
    for value in (given, json.dumps(given)):
        params = codec.decode_request(sampling({field: value}), None, MODEL, encode=lambda t: [1], decode=str)
        guided = params.sampling_params.guided_decoding
        assert guided is not None
        assert {key: getattr(guided, key) for key in expected} == expected
        others = set(codec.CONSTRAINT_KINDS) - set(expected)
        assert all(getattr(guided, key) is None for key in others)


def engine_tokenized(inputs: dict[str, np.ndarray], model: codec.ModelLimits = MODEL) -> codec.GenerationRequest:
    """As a V1 model's stub decodes: no tokenizer here (encode, decode None)."""
    return codec.decode_request(inputs, None, model, encode=None, decode=None)


def test_without_a_tokenizer_a_text_prompt_goes_to_the_engine_as_text() -> None:
    generation = engine_tokenized({"text_input": text("hello there"), "stream": boolean(False)})
    assert generation.prompt_token_ids == [] and generation.prompt_text == "hello there"
    assert generation.prepend_prompt  # a whole answer gets its prompt's text, which the stub has
    sent = codec.engine_request(generation, "r")
    assert sent.prompt_text == "hello there" and sent.prompt_token_ids == ()
    ids = engine_tokenized({"input_ids": np.array([1, 2], dtype=np.int32)})
    assert codec.engine_request(ids, "r").prompt_text is None  # token ids cross as ids


def test_without_a_tokenizer_token_ids_are_still_checked_here_and_what_needs_one_is_refused() -> None:
    too_long = {"input_ids": np.arange(1, 66, dtype=np.int32) % VOCAB}
    with pytest.raises(codec.RequestError, match="the prompt has 65 tokens, more than this model's limit of 64"):
        engine_tokenized(too_long)
    prepend_ids = {"input_ids": np.array([1, 2], dtype=np.int32), "exclude_input_in_output": boolean(False)}
    with pytest.raises(codec.RequestError, match="needs the prompt as 'text_input', not 'input_ids'"):
        engine_tokenized(prepend_ids)
    window = {"input_ids": np.array([1, 2], dtype=np.int32), "return_detokenization_window": boolean(True)}
    with pytest.raises(codec.RequestError, match="return_detokenization_window .* is not served on V1"):
        engine_tokenized(window)
    with pytest.raises(codec.RequestError, match="'text_input' is empty"):
        engine_tokenized({"text_input": text("")})


PRIORITY_MODEL = codec.ModelLimits(VOCAB, 64, scheduling_policy="priority")


def test_a_priority_comes_from_its_input_or_the_sampling_field_and_reaches_the_engine() -> None:
    as_input = request(sampling({}, priority=np.array([-3], dtype=np.int32)), model=PRIORITY_MODEL)
    assert as_input.priority == -3 and codec.engine_request(as_input, "r").priority == -3
    assert request(sampling({"priority": 7}), model=PRIORITY_MODEL).priority == 7
    assert request(sampling({"priority": "7"}), model=PRIORITY_MODEL).priority == 7  # numbers as strings
    both = request(sampling({"priority": 2}, priority=np.array([2], dtype=np.int32)), model=PRIORITY_MODEL)
    assert both.priority == 2
    assert request(sampling({}), model=PRIORITY_MODEL).priority == 0
    # KServe's request parameter `priority` is Triton's own scheduler's: never read as the request's.
    assert request({"text_input": text("hi")}, {"priority": 5}).priority == 0


@pytest.mark.parametrize(
    ("inputs", "model", "message"),
    [
        (
            sampling({"priority": 1}, priority=np.array([2], dtype=np.int32)),
            PRIORITY_MODEL,
            r"input 'priority' \(2\) and sampling_parameters.priority \(1\) disagree",
        ),
        (
            sampling({"priority": 4}),
            MODEL,
            r"sampling_parameters.priority is 4, but .* 'scheduling_policy' to \"priority\"",
        ),
        (sampling({}, priority=np.array([1], dtype=np.int32)), MODEL, r"input 'priority' is 1, but .*it is 'fcfs'"),
        (sampling({"priority": True}), PRIORITY_MODEL, "priority must be an integer, got a boolean"),
        (sampling({"priority": 1.5}), PRIORITY_MODEL, "priority must be an integer, got a number"),
        (sampling({}, priority=np.array([1.0], dtype=np.float32)), PRIORITY_MODEL, "input 'priority' must be INT32"),
        (sampling({}, priority=np.array([1, 2], dtype=np.int32)), PRIORITY_MODEL, "exactly one element"),
        (sampling({"priority": 2**31}), PRIORITY_MODEL, "must fit in INT32"),
    ],
)
def test_a_bad_or_unusable_priority_fails_naming_it(inputs: dict, model: codec.ModelLimits, message: str) -> None:
    with pytest.raises(codec.RequestError, match=message):
        request(inputs, model=model)


def test_prompt_logprobs_go_on_the_response_that_carries_them_with_null_for_the_first_token() -> None:
    generation = request(sampling({"prompt_logprobs": 1}, stream=boolean(True)))
    steps = [None, {5: TokenLogprob(-0.25, 1, "x")}, {6: TokenLogprob(-1.5, 2, "y"), 7: TokenLogprob(-0.5, 1, "z")}]
    first = EngineOutput("r", [Completion(0, "a", [1])], False, 3, prompt_logprobs=steps)
    arrays = codec.encode_response(first, generation, first=True)
    assert json.loads(arrays["prompt_logprobs"][0]) == [
        None,
        {"5": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}},
        {
            "6": {"logprob": -1.5, "rank": 2, "decoded_token": "y"},
            "7": {"logprob": -0.5, "rank": 1, "decoded_token": "z"},
        },
    ]
    later = codec.encode_response(EngineOutput("r", [Completion(0, "b", [2])], False), generation, first=False)
    assert "prompt_logprobs" not in later
    generation.outputs = frozenset({"text_output"})  # not asked for by name: not built
    assert "prompt_logprobs" not in codec.encode_response(first, generation, first=True)


EMBEDDER = codec.ModelLimits(vocab_size=VOCAB, max_model_len=64, tasks=("embed",), served_name="embedder")


def embedding_request(body: Any, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    return {"embedding_request": text(body if isinstance(body, str) else json.dumps(body)), **inputs}


def test_an_embedding_request_reaches_the_engine_as_its_prompt_and_pooling_fields() -> None:
    # Triton's OpenAI front end's form: the JSON, the two token counts, no text_input.
    decoded = request(
        embedding_request(
            {"input": "hello", "pooling_params": {"dimensions": [8]}},
            return_num_input_tokens=boolean(True),
            return_num_output_tokens=boolean(True),
        ),
        model=EMBEDDER,
    )
    assert isinstance(decoded, codec.EmbeddingRequest) and decoded.stream is False
    assert decoded.prompt_token_ids == encode("hello") and decoded.pooling == {"dimensions": 8}
    sent = codec.engine_request(decoded, "r1")
    assert sent.pooling == {"dimensions": 8} and sent.prompt_token_ids == tuple(encode("hello")) and not sent.sampling
    assert codec.completions_asked(decoded) == 1
    # Token ids, an empty text_input beside it (some clients send one), a plain dimensions number.
    by_ids = request(embedding_request({"input": [5, 6, 7], "pooling_params": {}}, text_input=text("")), model=EMBEDDER)
    assert by_ids.prompt_token_ids == [5, 6, 7] and by_ids.pooling == {}
    assert request(embedding_request({"input": "x", "pooling_params": {"dimensions": 3}}), model=EMBEDDER).pooling == {
        "dimensions": 3
    }
    # A V1 model's engine tokenizes the text itself.
    v1 = codec.decode_request(embedding_request({"input": "hello"}), None, EMBEDDER, None, None)
    assert v1.prompt_token_ids == [] and codec.engine_request(v1, "r2").prompt_text == "hello"


def test_an_embedding_response_is_the_vector_as_json_with_the_token_counts() -> None:
    decoded = request(
        embedding_request(
            {"input": "hey"}, return_num_input_tokens=boolean(True), return_num_output_tokens=boolean(True)
        ),
        model=EMBEDDER,
    )
    vector = [0.25, -1.5, 3.0000001192092896]
    arrays = codec.encode_response(EngineOutput("r", [], True, 3, embedding=vector), decoded, first=True)
    assert json.loads(arrays["text_output"][0]) == vector
    assert arrays["num_input_tokens"].tolist() == [3] and arrays["num_output_tokens"].tolist() == [0]
    plain = request(embedding_request({"input": "hey"}), model=EMBEDDER)
    assert set(codec.encode_response(EngineOutput("r", [], True, 3, embedding=vector), plain, first=True)) == {
        "text_output"
    }


@pytest.mark.parametrize(
    ("inputs", "model", "message"),
    [
        (
            embedding_request({"input": "hi"}),
            MODEL,
            "Error generating stream: Model this model does not support 'embed' request",
        ),
        (
            {"text_input": text("hi")},
            EMBEDDER,
            "Error generating stream: Model embedder does not support 'generate' request",
        ),
        (embedding_request("{nope"), EMBEDDER, "input 'embedding_request' is not valid JSON"),
        (embedding_request([1, 2]), EMBEDDER, "input 'embedding_request' must be a JSON object, got an array"),
        (embedding_request({}), EMBEDDER, "embedding_request.input is required"),
        (embedding_request({"input": ""}), EMBEDDER, "embedding_request.input is empty"),
        (embedding_request({"input": []}), EMBEDDER, "embedding_request.input is empty"),
        (embedding_request({"input": ["a", "b"]}), EMBEDDER, "must be a string or a list of token ids (one input"),
        (embedding_request({"input": [1, True]}), EMBEDDER, "must be a string or a list of token ids"),
        (embedding_request({"input": [1, VOCAB]}), EMBEDDER, f"token id {VOCAB} is outside the vocabulary"),
        (
            embedding_request({"input": "x" * 65}),
            EMBEDDER,
            "the prompt has 65 tokens, more than this model's limit of 64",
        ),
        (embedding_request({"input": "x", "model": "m"}), EMBEDDER, "embedding_request.model is not a field"),
        (embedding_request({"input": "x", "pooling_params": []}), EMBEDDER, "pooling_params must be a JSON object"),
        (
            embedding_request({"input": "x", "pooling_params": {"normalize": True}}),
            EMBEDDER,
            "pooling_params.normalize",
        ),
        (
            embedding_request({"input": "x", "pooling_params": {"dimensions": 0}}),
            EMBEDDER,
            "dimensions must be an integer >= 1",
        ),
        (embedding_request({"input": "x", "pooling_params": {"dimensions": [2, 3]}}), EMBEDDER, "dimensions must be"),
        (
            embedding_request({"input": "x"}, text_input=text("y")),
            EMBEDDER,
            "'text_input' and 'embedding_request' both",
        ),
        (
            embedding_request({"input": "x"}, stream=boolean(True)),
            EMBEDDER,
            "input 'stream' does not apply to an embedding",
        ),
        (
            embedding_request({"input": "x"}, return_logprobs=boolean(True)),
            EMBEDDER,
            "input 'return_logprobs' does not",
        ),
        (embedding_request({"input": "x"}, sampling_parameters=text("{}")), EMBEDDER, "'sampling_parameters' does not"),
        (embedding_request({"input": "x"}, input_ids=np.array([1], np.int32)), EMBEDDER, "'input_ids' does not apply"),
        (embedding_request({"input": "x"}, priority=np.array([3], np.int32)), EMBEDDER, "schedules first come"),
    ],
)
def test_a_bad_embedding_request_fails_naming_the_field(inputs: dict, model: codec.ModelLimits, message: str) -> None:
    with pytest.raises(codec.RequestError, match=None) as raised:
        request(inputs, model=model)
    assert message in str(raised.value)


def test_false_flags_and_a_priority_are_taken_with_an_embedding_request() -> None:
    model = codec.ModelLimits(vocab_size=VOCAB, max_model_len=64, tasks=("embed",), scheduling_policy="priority")
    decoded = request(
        embedding_request({"input": "x"}, stream=boolean(False), priority=np.array([-2], np.int32)), model=model
    )
    assert decoded.priority == -2 and codec.engine_request(decoded, "r").priority == -2


V1_DECODE = """
import json, sys
import numpy as np
from triton_vllm_multistep.stub import codec

model = codec.ModelLimits(vocab_size=100, max_model_len=64, checks_with_vllm=False)
def text(value):
    return np.array([value.encode()], dtype=np.object_)
fields = {"temperature": "0.5", "n": 2, "max_tokens": 7, "logit_bias": {"7": -1}}
fields["guided_decoding"] = {"choice": ["a", "b"]}
inputs = {"text_input": text("hello"), "sampling_parameters": text(json.dumps(fields)), "stream": np.array([True])}
try:
    codec.decode_request(inputs, None, model, None, None)
except codec.RequestError as error:  # guided decoding with n=2: refused here, as on the multi-step engine
    refused = str(error)
fields.pop("guided_decoding")
inputs["sampling_parameters"] = text(json.dumps(fields))
generation = codec.decode_request(inputs, None, model, None, None)
print(json.dumps({
    "sampling": generation.sampling, "params": generation.sampling_params is None, "refused": refused,
    "completions": codec.completions_asked(generation),
    "vllm": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")), "torch": "torch" in sys.modules,
}))
"""


def test_a_v1_models_request_is_checked_without_vllm() -> None:
    """A V1 model's stub checks a request's fields (names, types, ranges, the rules of its own) without
    vLLM 0.8.5, whose SamplingParams rules are not V1's: its engine process checks them with V1's own
    (that request alone refused in vLLM's words). In a fresh interpreter: no vLLM module is imported."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", V1_DECODE], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["vllm"] == [] and not seen["torch"]
    assert seen["params"] and seen["completions"] == 2
    assert seen["sampling"] == {
        "temperature": 0.5, "n": 2, "max_tokens": 7, "logit_bias": {"7": -1}, "output_kind": "DELTA"
    }  # fmt: skip
    assert "supports one sequence per request" in seen["refused"]
