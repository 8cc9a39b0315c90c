"""The ensemble's preprocessing and postprocessing models, run as Triton runs them (initialize with
the model config, execute on a dynamic batch) with a fake pb_utils and the demo tokenizers.

What the ensemble does through a real server (text equal to the LLM model's, both tokenizers,
stop strings, bad input) is in tests/e2e/test_ensemble.py.
"""

from __future__ import annotations

import json
from typing import Any

import fake_pb_utils as pb
import numpy as np
import pytest
from transformers import AutoTokenizer

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.stub import tokenizer_stages
from triton_vllm_multistep.stub.detokenization import text_window, window_decoder

PRE_INPUTS = [
    "text_input",
    "messages",
    "sampling_parameters",
    *tokenizer_stages.SCALAR_FIELDS,
    "stop_words",
    "bad_words",
]


@pytest.fixture(scope="module")
def bpe() -> Any:
    return AutoTokenizer.from_pretrained(demo_models.build("tiny-llama-bpe"))


@pytest.fixture(scope="module")
def preprocessing() -> Any:
    model = tokenizer_stages.python_model(pb, tokenizer_stages.Preprocessor, tokenizers_only=False)()
    model.initialize(pb.initialize_args(pb.model_config(PRE_INPUTS)))  # no tokenizer_dir: the demo default
    return model


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def run(model: Any, *inputs: dict[str, np.ndarray]) -> list[pb.InferenceResponse]:
    return model.execute([pb.InferenceRequest(i) for i in inputs])


def sampling_of(response: pb.InferenceResponse) -> dict[str, Any]:
    return json.loads(response.arrays()["sampling_parameters"].reshape(-1)[0])


def test_text_and_settings_become_the_llm_models_inputs(preprocessing: Any, bpe: Any) -> None:
    (response,) = run(
        preprocessing,
        {
            "text_input": text("cats sleep"),
            "sampling_parameters": text('{"temperature": 0.5, "stop": "x", "max_tokens": 3}'),
            "max_tokens": np.array([[5]], np.int32),  # the scalar input wins over the JSON
            "random_seed": np.array([[7]], np.uint64),
            "min_length": np.array([[2]], np.int32),
            "top_p": np.array([[0.9]], np.float32),
            "stop_words": np.array([[b"END", b""]], np.object_),  # empty words are padding
            "bad_words": np.array([[b"bad"]], np.object_),
        },
    )
    assert not response.has_error()
    arrays = response.arrays()
    assert arrays["input_ids"].dtype == np.int32 and arrays["input_ids"].tolist() == [bpe.encode("cats sleep")]
    assert arrays["return_detokenization_window"].tolist() == [[True]]
    assert arrays["exclude_input_in_output"].tolist() == [[True]]
    fields = sampling_of(response)
    assert fields == {
        "temperature": 0.5,
        "stop": ["x", "END"],
        "max_tokens": 5,
        "seed": 7,
        "min_tokens": 2,
        "top_p": pytest.approx(0.9),
        "bad_words": ["bad"],
    }


def test_chat_messages_go_through_the_chat_template_once(preprocessing: Any, bpe: Any) -> None:
    messages = [{"role": "user", "content": "hello"}]
    (response,) = run(preprocessing, {"messages": text(json.dumps(messages))})
    expected = bpe.encode(
        bpe.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert response.arrays()["input_ids"].tolist() == [expected]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"max_tokens": np.array([[0]], np.int32)}, "input 'max_tokens' must be >= 1, got 0"),
        ({"max_tokens": np.array([[1, 2]], np.int32)}, "input 'max_tokens' must hold one value, got 2"),
        ({"sampling_parameters": text("{oops")}, "input 'sampling_parameters' is not valid JSON"),
        ({"sampling_parameters": text("[]")}, "input 'sampling_parameters' must be a JSON object"),
        ({"text_input": None, "messages": text("not json")}, "input 'messages' is not valid JSON"),
        ({"text_input": None, "messages": text('[{"role": "user"}]')}, "input 'messages' must be a JSON list of"),
        ({"text_input": None}, "input 'text_input' is required (or 'messages' for a chat)"),
        ({"text_input": text("")}, "input 'text_input' is empty"),
        ({"stop_words": np.array([[b"\xff"]], np.object_)}, "input 'stop_words' is not valid UTF-8"),
    ],
)
def test_a_bad_request_gets_its_own_error_and_the_batch_goes_on(
    preprocessing: Any, inputs: dict[str, Any], message: str
) -> None:
    bad = {k: v for k, v in ({"text_input": text("hi")} | inputs).items() if v is not None}
    first, failed, last = run(preprocessing, {"text_input": text("a")}, bad, {"text_input": text("b")})
    assert not first.has_error() and not last.has_error()
    assert failed.has_error() and failed.error().code() == pb.TritonError.INVALID_ARG
    assert message in failed.error().message()


def test_postprocessing_turns_a_window_into_the_exact_delta() -> None:
    model = tokenizer_stages.python_model(pb, tokenizer_stages.Postprocessor, tokenizers_only=False)()
    config = pb.model_config(["window_ids", "window_offsets"], {"tokenizer_dir": "demo://tiny-llama-spm"})
    model.initialize(pb.initialize_args(config))
    spm = AutoTokenizer.from_pretrained(demo_models.build("tiny-llama-spm"))
    prompt = spm.encode("say")
    output = spm.encode(" hello world", add_special_tokens=False)
    replay = window_decoder(spm)
    delta = replay(prompt + output, len(prompt))[-len(" world") :]  # the last word, its space included
    assert delta == " world"
    window = text_window(prompt + output, len(prompt), 1, delta, replay)
    good = {
        "window_ids": np.array([window.ids], np.int32),
        "window_offsets": np.array([[window.context, window.start, window.end]], np.int32),
    }
    done, missing, outside = run(
        model, good, {"window_ids": good["window_ids"]}, good | {"window_offsets": np.array([[0, 0, 999]], np.int32)}
    )
    assert done.arrays()["text_output"].tolist() == [[b" world"]]
    assert "inputs 'window_ids' and 'window_offsets' are required" in missing.error().message()
    assert outside.error().code() == pb.TritonError.INVALID_ARG and "outside the window" in outside.error().message()
