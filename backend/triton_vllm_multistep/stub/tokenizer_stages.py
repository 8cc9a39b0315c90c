"""The `preprocessing` and `postprocessing` models of the ensemble: text → ids, ids → text.

Owns turning ensemble inputs (TensorRT-LLM's names where the meaning is the same) into the
LLM model's `input_ids` + `sampling_parameters`, and decoding detokenization windows back to
text; must not keep per-request state (both run with dynamic batching, one request at a time).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.interface import (
    BAD_WORDS,
    EXCLUDE_INPUT_IN_OUTPUT,
    INPUT_IDS,
    MESSAGES,
    RETURN_DETOKENIZATION_WINDOW,
    SAMPLING_PARAMETERS,
    SCALAR_FIELDS,
    STOP_WORDS,
    TEXT_INPUT,
    TEXT_OUTPUT,
    WINDOW_IDS,
    WINDOW_OFFSETS,
)
from triton_vllm_multistep.settings.parameters import parameter_values
from triton_vllm_multistep.stub import stall_guard, triton_io
from triton_vllm_multistep.stub.codec import (
    RequestError,
    check_max_tokens,
    parse_sampling_fields,
    string_input,
    string_value,
)
from triton_vllm_multistep.stub.detokenization import slice_window, window_decoder

DEFAULT_TOKENIZER = "demo://tiny-llama-bpe"
# config.pbtxt `vllm_engine` on a stage: the engine of the LLM model behind it ("multistep", the
# default: this environment's tokenizer; "v1": the V1 environment's, stub/v1_tokenizer.py).
STAGE_ENGINES = ("multistep", "v1")


def use_tokenizers_only() -> None:
    """This process's transformers, once imported, without torch (or TF, Flax): a tokenizer stage runs
    no model, and transformers imports torch whenever it is installed (measured loading a stage's
    tokenizer: 2.5-3.0 s and 544-606 MB of memory with it, 0.7-0.9 s and 85-135 MB without, the same
    ids, texts and chat templates). For a stage's stub only: it holds for the whole process, and
    does nothing once transformers is imported (its framework checks run at its import)."""
    if "transformers" not in sys.modules:
        os.environ["USE_TORCH"] = os.environ["USE_TF"] = os.environ["USE_FLAX"] = "0"
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its "no framework found" notice


def load_tokenizer(reference: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_models.resolve(reference))


def _word_list(name: str, array: np.ndarray) -> list[str]:
    return [word for word in (string_value(name, value) for value in array.reshape(-1)) if word]


class Preprocessor:
    """Text (or chat messages) and generation settings → what the LLM model accepts."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        if MESSAGES in inputs:
            try:
                messages = json.loads(string_input(MESSAGES, inputs[MESSAGES]))
            except json.JSONDecodeError as error:
                raise RequestError(f"input '{MESSAGES}' is not valid JSON: {error.msg}") from None
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise RequestError(f'input \'{MESSAGES}\' must be a JSON list of {{"role": ..., "content": ...}}')
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template writes the BOS itself; don't add a second one.
            return self.tokenizer.encode(text, add_special_tokens=False)
        if TEXT_INPUT not in inputs:
            raise RequestError(f"input '{TEXT_INPUT}' is required (or '{MESSAGES}' for a chat)")
        text = string_input(TEXT_INPUT, inputs[TEXT_INPUT])
        if not text:
            raise RequestError(f"input '{TEXT_INPUT}' is empty")
        return self.tokenizer.encode(text)

    def sampling_parameters(self, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if SAMPLING_PARAMETERS in inputs:
            text = string_input(SAMPLING_PARAMETERS, inputs[SAMPLING_PARAMETERS])
            fields = parse_sampling_fields(text, f"input '{SAMPLING_PARAMETERS}'")
        for name, (field_name, kind) in SCALAR_FIELDS.items():
            if name in inputs:
                values = inputs[name].reshape(-1)
                if values.size != 1:
                    raise RequestError(f"input '{name}' must hold one value, got {values.size}")
                fields[field_name] = kind(values[0].item())
        max_tokens = fields.get("max_tokens")
        if isinstance(max_tokens, int):
            check_max_tokens(max_tokens, "input 'max_tokens'")
        if STOP_WORDS in inputs:
            fields["stop"] = [*_listify(fields.get("stop")), *_word_list(STOP_WORDS, inputs[STOP_WORDS])]
        if BAD_WORDS in inputs:  # vLLM's sampling field of the same name
            fields["bad_words"] = [*_listify(fields.get("bad_words")), *_word_list(BAD_WORDS, inputs[BAD_WORDS])]
        return fields

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = self.prompt_ids(inputs)
        fields = self.sampling_parameters(inputs)
        return {
            INPUT_IDS: np.array([ids], dtype=np.int32),
            SAMPLING_PARAMETERS: np.array([[json.dumps(fields).encode()]], dtype=np.object_),
            # The LLM model sends text windows only when asked; the ensemble always asks.
            RETURN_DETOKENIZATION_WINDOW: np.array([[True]]),
            # The answer alone, streamed or whole (what postprocessing's windows give): the ensemble on a
            # V1 model, whose text_output is the ensemble's, maps it (docs/ensemble.md).
            EXCLUDE_INPUT_IN_OUTPUT: np.array([[True]]),
        }


def _listify(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class Postprocessor:
    """Detokenization window from the LLM model → the exact text delta, statelessly."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = window_decoder(tokenizer)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if WINDOW_IDS not in inputs or WINDOW_OFFSETS not in inputs:
            raise RequestError(f"inputs '{WINDOW_IDS}' and '{WINDOW_OFFSETS}' are required")
        ids = [int(t) for t in inputs[WINDOW_IDS].reshape(-1)]
        text = slice_window(ids, inputs[WINDOW_OFFSETS].reshape(-1), self.decode)
        return {TEXT_OUTPUT: np.array([[text.encode("utf-8")]], dtype=np.object_)}


def run_batch(
    pb_utils: Any, requests: list[Any], names: list[str], handler: Callable[[Mapping[str, np.ndarray]], dict]
) -> list[Any]:
    """One response per request of a dynamic batch; a bad request gets its own error only."""
    responses = []
    for request in requests:
        try:
            responses.append(triton_io.response(pb_utils, handler(triton_io.input_arrays(pb_utils, request, names))))
        except (RequestError, ValueError, TypeError, OverflowError) as error:
            responses.append(triton_io.error_response(pb_utils, str(error), pb_utils.TritonError.INVALID_ARG))
    return responses


def stage_engine(parameters: Mapping[str, str], handler_class: type) -> str:
    """config.pbtxt `vllm_engine` of a tokenizer stage, checked: "v1" runs a preprocessing stage's
    tokenizer in the V1 environment; a postprocessing stage has nothing to do for a V1 model, whose
    `text_output` is already each step's exact text (made in the V1 environment): a load error saying so."""
    engine = parameters.get("vllm_engine") or STAGE_ENGINES[0]
    if engine not in STAGE_ENGINES:
        raise ValueError(
            f"config.pbtxt parameter 'vllm_engine' must be one of {', '.join(STAGE_ENGINES)}, got {engine!r}"
        )
    if engine == "v1" and handler_class is Postprocessor:
        raise ValueError(
            "config.pbtxt parameter 'vllm_engine' is 'v1' on a postprocessing stage: a V1 model's text_output is "
            "each step's exact text already; map it to the ensemble's text_output instead of this stage "
            '(docs/ensemble.md, "The ensemble on V1 models")'
        )
    return engine


def python_model(
    pb_utils: Any, handler_class: type[Preprocessor] | type[Postprocessor], tokenizers_only: bool = True
) -> type:
    """The `TritonPythonModel` class of a tokenizer stage (its model.py is one line); called at that
    model.py's import, so it starts the stub's guard (Triton's auto-complete stub is guarded too) and
    leaves torch out of the stub (`use_tokenizers_only`; not for a process that needs torch too)."""
    stall_guard.guard_this_stub()
    if tokenizers_only:
        use_tokenizers_only()

    class TritonPythonModel:
        def initialize(self, args: dict[str, str]) -> None:
            self._guard = stall_guard.start_for(args)
            self._v1_tokenizer: Any = None
            try:
                config = json.loads(args["model_config"])
                self._names = [item["name"] for item in config["input"]]
                parameters = parameter_values(config)
                tokenizer_dir = parameters.get("tokenizer_dir") or DEFAULT_TOKENIZER
                if stage_engine(parameters, handler_class) == "v1":
                    from triton_vllm_multistep.stub.v1_tokenizer import V1Tokenizer

                    self._v1_tokenizer = V1Tokenizer(demo_models.resolve(tokenizer_dir))
                    self._handler = handler_class(self._v1_tokenizer)
                else:
                    self._handler = handler_class(load_tokenizer(tokenizer_dir))
            except BaseException:
                self.finalize()  # a failed load ends the stub: an expected exit
                raise

        def execute(self, requests: list[Any]) -> list[Any]:
            return run_batch(pb_utils, requests, self._names, self._handler)

        def finalize(self) -> None:
            if self._v1_tokenizer is not None:
                self._v1_tokenizer.close()
            self._guard.finalizing()

    return TritonPythonModel
