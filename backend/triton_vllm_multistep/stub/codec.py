"""Request/response codec: Triton input arrays ⇄ typed generation requests and response arrays.

Owns all input validation and every client-visible error message, and the EngineRequest a request
becomes (engine/events.py: plain values; vLLM's SamplingParams is built here only to check the
fields, and again by the engine from the same fields, engine/admission.py); must not touch the
engine, threads or pb_utils (model.py hands it plain numpy arrays and strings).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # vLLM is imported where used: auto_complete_config's stub never needs it
    from vllm.sampling_params import SamplingParams

from triton_vllm_multistep.engine.events import (
    EMPTY_PROMPT_MESSAGE,
    EngineOutput,
    EngineRequest,
    RequestTimes,
    TokenLogprob,
    prompt_limit,
    prompt_too_long_message,
)
from triton_vllm_multistep.interface import (
    BOOL_INPUTS,
    DIMENSIONS_FIELD,
    EMBED_TASK,
    EMBEDDING_INPUT_FIELD,
    EMBEDDING_REQUEST,
    GENERATE_TASK,
    IMAGE_INPUT,
    LORA_NAME_FIELD,
    LORA_OFF_MESSAGE,
    NUM_CACHED_TOKENS,
    PERF_TIME_OUTPUTS,
    POOLING_PARAMS_FIELD,
    PRIORITY,
    PRIORITY_FIELD,
    PROMPT_LOGPROBS,
    RETURN_FLAGS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    STREAM_WITH_PROMPT_MESSAGE,
    TEXT_INPUT,
    unsupported_task_message,
)
from triton_vllm_multistep.interface import SAMPLING_PARAMETERS as SAMPLING_TENSOR
from triton_vllm_multistep.output_tap import (
    TAP_PARAMETERS,
    TAP_SOCKET_PARAMETER,
    TapAddress,
    TapRequestError,
    tap_address,
)
from triton_vllm_multistep.settings.backend import MAX_STREAM_INTERVAL, Limits
from triton_vllm_multistep.settings.lora import Adapter
from triton_vllm_multistep.stub.detokenization import text_window
from triton_vllm_multistep.stub.images import ImageError, read_images


class RequestError(ValueError):
    """A request is invalid; the message names the offending input or field. `log_detail`: what the
    server log adds where the message must be another backend's words exactly."""

    def __init__(self, message: str, log_detail: str | None = None) -> None:
        super().__init__(message)
        self.log_detail = log_detail


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise RequestError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise RequestError(f"{name}: expected an integer, got {value!r}")


def _to_logprobs(name: str, value: Any) -> int:
    """A count of top logprobs; a boolean as vLLM reads one (False 0, True 1): Triton's own OpenAI
    frontend (r24.11-r25.11) sends `"logprobs": false` with every chat request."""
    return int(value) if isinstance(value, bool) else _to_int(name, value)


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise RequestError(f"{name}: expected a number, got {value!r}")
    if isinstance(value, int | float):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise RequestError(f"{name}: expected a number, got {value!r}") from None
    else:
        raise RequestError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(result):
        raise RequestError(f"{name}: must be a finite number, got {value!r}")
    return result


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RequestError(f"{name}: expected true or false, got {value!r}")


def _to_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise RequestError(f"{name}: expected a string or a list of strings")


def _to_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise RequestError(f"{name}: expected a list of integers")
    return [_to_int(f"{name}[{index}]", item) for index, item in enumerate(value)]


def _to_logit_bias(name: str, value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise RequestError(f"{name}: expected an object of token id → bias")
    return {_to_int(f"{name} key", key): _to_float(f"{name}[{key}]", bias) for key, bias in value.items()}


# SamplingParams fields a request may set, with the conversion that gives the field's type.
FIELD_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    "n": _to_int,
    "best_of": _to_int,
    "presence_penalty": _to_float,
    "frequency_penalty": _to_float,
    "repetition_penalty": _to_float,
    "temperature": _to_float,
    "top_p": _to_float,
    "top_k": _to_int,
    "min_p": _to_float,
    "seed": _to_int,
    "stop": _to_str_list,
    "stop_token_ids": _to_int_list,
    "ignore_eos": _to_bool,
    "max_tokens": _to_int,
    "min_tokens": _to_int,
    "logprobs": _to_logprobs,
    "prompt_logprobs": _to_int,
    "skip_special_tokens": _to_bool,
    "spaces_between_special_tokens": _to_bool,
    "include_stop_str_in_output": _to_bool,
    "truncate_prompt_tokens": _to_int,
    "logit_bias": _to_logit_bias,
    "allowed_token_ids": _to_int_list,
    "bad_words": _to_str_list,
}
# Fields that exist in vLLM but that a request must not set here, and why.
REFUSED_FIELDS = {
    "logits_processors": "logits processors are not supported with multi-step scheduling",
    "output_kind": "set by the backend from the 'stream' input",
    "detokenize": "the backend always detokenizes (text_output)",
    "output_text_buffer_length": "internal to vLLM",
    "extra_args": "not accepted from requests",
}
# Structured output, as Triton's vLLM backend takes it in sampling_parameters (r25.01-r25.10:
# "guided_decoding", r25.11+: "structured_outputs"): vLLM's GuidedDecodingParams fields, as a JSON
# string (their form) or an object. One kind of constraint per request; the options go with it.
STRUCTURED_OUTPUT_FIELDS = ("guided_decoding", "structured_outputs")
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
CONSTRAINT_OPTIONS = ("backend", "whitespace_pattern")
# vLLM 0.8.5's guided-decoding backends (all four run on CPU; model.json guided_decoding_backend
# picks the default, "auto" in vLLM), each optionally followed by ":options".
GUIDED_BACKENDS = ("auto", "xgrammar", "outlines", "lm-format-enforcer", "guidance")
# Keys Triton or its clients put in request parameters that are not sampling fields.
TRITON_RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "stream", *TAP_PARAMETERS}
)
MAX_SEED = 2**63 - 1
REQUEST_PARAMETERS = "parameters"  # how errors name a field that came from the request parameters


@dataclass(frozen=True)
class ReturnFlags:
    """Which optional outputs the client asked for."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    detokenization_window: bool = False  # window_ids + window_offsets, for postprocessing
    perf_metrics: bool = False  # the timings and num_cached_tokens, on the FINAL response


@dataclass
class GenerationRequest:
    """A validated request, ready for the engine (`engine_request` makes what the engine gets)."""

    prompt_token_ids: list[int]
    # Checked here (None for an engine process: ModelLimits.checks_with_vllm); the engine builds its
    # own from `sampling`.
    sampling_params: SamplingParams | None
    stream: bool
    prompt_text: str | None = None
    prepend_prompt: bool = False
    returns: ReturnFlags = field(default_factory=ReturnFlags)
    # Prompt + output ids so far; kept only when detokenization windows are asked for.
    context_ids: list[int] | None = None
    # Engine outputs per streamed response, when the request sets its own (`stream_interval`).
    stream_interval: int | None = None
    # The outputs the client (or the ensemble step) asked for; None: all. Only these are built.
    outputs: frozenset[str] | None = None
    adapter: Adapter | None = None  # `lora_name`'s adapter; None: the base model
    images: tuple[bytes, ...] = ()  # checked image files for the prompt's placeholders (stub/images.py)
    # The prompt's token count as the engine counts it (image placeholders expanded), once known.
    engine_prompt_tokens: int | None = None
    # `sampling_params` as plain values (EngineRequest.sampling): vLLM field name → JSON value.
    sampling: dict[str, Any] = field(default_factory=dict)
    sampling_source: str = SAMPLING_TENSOR  # where `sampling` came from, as errors name it
    priority: int = 0  # vLLM's request priority (lower first)
    # Where its data responses go instead of Triton (output_tap.py), when an OpenAI server asked.
    tap: TapAddress | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.engine_prompt_tokens if self.engine_prompt_tokens is not None else len(self.prompt_token_ids)

    def wants(self, name: str) -> bool:
        return self.outputs is None or name in self.outputs


@dataclass(frozen=True)
class ModelLimits:
    """What the engine and config allow, as the codec needs it."""

    vocab_size: int
    max_model_len: int
    limits: Limits = field(default_factory=Limits)
    model_name: str = "this model"  # the engine's model, for errors about what it cannot take
    images_per_prompt: int = 0  # vLLM's limit_mm_per_prompt for images; 0: a text-only model
    adapters: tuple[Adapter, ...] | None = None  # multi_lora.json's, in its order; None: LoRA off
    scheduling_policy: str = "fcfs"  # the engine's (model.json scheduling_policy): "priority" takes priorities
    tasks: tuple[str, ...] = (GENERATE_TASK,)  # what the model serves (EngineFacts.tasks)
    served_name: str = "this model"  # the Triton model's name, as Triton's vLLM backend names it in errors
    # Sampling fields checked here with vLLM 0.8.5's SamplingParams, the multi-step engine's own rules,
    # where the engine runs in the stub; False for an engine process (either engine): it checks them
    # with its vLLM, refusing that request alone, and the stub imports no vLLM at all.
    checks_with_vllm: bool = True


@dataclass
class EmbeddingRequest:
    """A validated embedding request (`embedding_request`): pooled once, answered by one FINAL response
    holding the vector. Has what the responder reads of any request (`stream`, `images`, ...)."""

    prompt_token_ids: list[int]  # empty when the engine tokenizes `prompt_text` (a V1 model's)
    pooling: dict[str, Any]  # vLLM's PoolingParams fields (EngineRequest.pooling)
    prompt_text: str | None = None
    returns: ReturnFlags = field(default_factory=ReturnFlags)
    outputs: frozenset[str] | None = None
    priority: int = 0
    engine_prompt_tokens: int | None = None  # the prompt's token count as the engine counts it, once known
    stream: bool = False
    stream_interval: int | None = None
    images: tuple[bytes, ...] = ()
    tap: TapAddress | None = None  # never: its one response goes through Triton (decode_request refuses one)

    @property
    def prompt_tokens(self) -> int:
        return self.engine_prompt_tokens if self.engine_prompt_tokens is not None else len(self.prompt_token_ids)

    def wants(self, name: str) -> bool:
        return self.outputs is None or name in self.outputs


def _payload_bytes(array: np.ndarray) -> int:
    if array.dtype != np.object_:
        return array.nbytes
    return sum(len(item) if isinstance(item, bytes | str) else 8 for item in array.reshape(-1))


def _scalar(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _bool_input(name: str, array: np.ndarray | None) -> bool | None:
    if array is None:
        return None
    value = _scalar(name, array)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, np.integer) and int(value) in (0, 1):
        return bool(value)
    raise RequestError(f"input '{name}' must be BOOL, got {array.dtype}")


def string_value(name: str, value: Any, dtype: Any = None) -> str:
    """One element of a STRING (BYTES) input as text; errors name the input."""
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"input '{name}' is not valid UTF-8: {error.reason} at byte {error.start}") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"input '{name}' must be STRING (BYTES), got {dtype or type(value).__name__}")


def string_input(name: str, array: np.ndarray) -> str:
    """A STRING input that must hold exactly one element, as text."""
    return string_value(name, _scalar(name, array), array.dtype)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


def _json_loads(text: str, error_prefix: str) -> Any:
    """json.loads, a RequestError `<error_prefix>: <what is wrong> at position <n>` if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"{error_prefix}: {error.msg} at position {error.pos}") from None


def parse_sampling_fields(text: str | None, source: str) -> dict[str, Any]:
    """A JSON object of sampling fields → raw dict (validated for shape only)."""
    if text is None or not text.strip():
        return {}
    data = _json_loads(text, f"{source} is not valid JSON")
    if not isinstance(data, dict):
        raise RequestError(f"{source} must be a JSON object, got {_json_type(data)}")
    return data


def structured_output(name: str, value: Any) -> dict[str, Any]:
    """`guided_decoding` / `structured_outputs` (a JSON string or an object of GuidedDecodingParams
    fields) → the GuidedDecodingParams fields it sets, as JSON values (the JSON schema as an object);
    every error names `name` and the problem. What only the backend can judge (a regex, schema or
    grammar it cannot compile) fails when the engine builds it."""
    if isinstance(value, str):
        value = _json_loads(value, f"{name} is not valid JSON")
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be a JSON object (or a string holding one), got {_json_type(value)}")
    known = (*CONSTRAINT_KINDS, *CONSTRAINT_OPTIONS)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise RequestError(f"{name}.{unknown[0]} is not a field of vLLM's GuidedDecodingParams ({', '.join(known)})")
    kinds = [kind for kind in CONSTRAINT_KINDS if value.get(kind) not in (None, False)]
    if len(kinds) != 1:
        found = f"got {' and '.join(kinds)}" if kinds else "got none"
        raise RequestError(f"{name} needs exactly one of {', '.join(CONSTRAINT_KINDS)}: {found}")
    (kind,) = kinds
    constraint = value[kind]
    where = f"{name}.{kind}"
    if kind == "json":
        if isinstance(constraint, str):
            constraint = _json_loads(constraint, f"{where} is not a valid JSON schema")
        if not isinstance(constraint, dict):
            raise RequestError(f"{where} must be a JSON schema (an object), got {_json_type(constraint)}")
    elif kind == "choice":
        if not isinstance(constraint, list) or not constraint or not all(isinstance(c, str) and c for c in constraint):
            raise RequestError(f"{where} must be a non-empty list of non-empty strings")
    elif kind == "json_object":
        if constraint is not True:
            raise RequestError(f"{where} must be true")
    elif not isinstance(constraint, str) or not constraint:
        raise RequestError(f"{where} must be a non-empty string")
    options = {option: value[option] for option in CONSTRAINT_OPTIONS if value.get(option) is not None}
    for option, setting in options.items():
        if not isinstance(setting, str):
            raise RequestError(f"{name}.{option} must be a string, got {_json_type(setting)}")
    backend = options.get("backend")
    if backend is not None and backend.split(":")[0] not in GUIDED_BACKENDS:
        raise RequestError(
            f"{name}.backend must be one of {', '.join(GUIDED_BACKENDS)} (vLLM 0.8.5's), got {backend!r}"
        )
    return {kind: constraint, **options}


def import_sampling_checks() -> None:
    """Import what `sampling_params` checks with (vLLM's SamplingParams) now, on the thread loading
    the model, never first inside execute(): vLLM 0.8.5 keeps the traceback of its failed `import ray`
    (vllm/executor/ray_utils.py), and with it every frame of the stack that first imported vLLM. From
    execute() that stack holds the batch's Triton request objects for the stub's whole life; their
    destructors then run at the stub's exit, after Triton has released the stub's shared memory: the
    stub aborts (`boost::interprocess::lock_exception`) or never exits, and Triton waits for it
    forever (the unload never completes; the server's stop runs into its exit timeout). Measured on a
    V1 model's stub, which imported vLLM for nothing else (it now imports none: ModelLimits.checks_with_vllm;
    docs/lifecycle.md)."""
    import vllm.sampling_params  # noqa: F401


def sampling_params(
    fields: Mapping[str, Any], stream: bool, limits: ModelLimits, source: str = SAMPLING_TENSOR
) -> tuple[SamplingParams | None, dict[str, Any]]:
    """Convert and check sampling fields; every error names the field as `<source>.<field>`.

    Returns vLLM's SamplingParams (built to check the fields as vLLM 0.8.5 does; None when the
    model's engine checks them: `limits.checks_with_vllm`) and the same fields as plain values,
    what the engine builds its own from (EngineRequest.sampling).
    """
    kwargs: dict[str, Any] = {}
    guided: dict[str, Any] | None = None
    given = [name for name in STRUCTURED_OUTPUT_FIELDS if fields.get(name) is not None]
    if len(given) > 1:
        raise RequestError(f"{source}: {' and '.join(given)} are two names for one setting; give one")
    for name, value in fields.items():
        if name in STRUCTURED_OUTPUT_FIELDS:
            if value is not None:
                guided = structured_output(f"{source}.{name}", value)
            continue
        if name in REFUSED_FIELDS:
            raise RequestError(f"{source}.{name} is not accepted: {REFUSED_FIELDS[name]}")
        converter = FIELD_CONVERTERS.get(name)
        if converter is None:
            raise RequestError(f"{source}.{name} is not a known vLLM sampling parameter")
        if value is not None:
            kwargs[name] = converter(f"{source}.{name}", value)
    _check_ranges(kwargs, limits, source)
    if guided is not None and sequences(kwargs) > 1:
        # One constraint per sequence is what is built and checked exact here.
        raise RequestError(f"{source}.{given[0]} supports one sequence per request (n=1, no best_of)")
    plain = {**kwargs, "output_kind": "DELTA" if stream else "FINAL_ONLY"}
    if guided is not None:
        plain["guided_decoding"] = guided
    if "logit_bias" in plain:
        plain["logit_bias"] = {str(token): bias for token, bias in plain["logit_bias"].items()}  # JSON keys
    if not limits.checks_with_vllm:
        return None, plain
    from vllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

    checked = {**kwargs, "output_kind": RequestOutputKind[plain["output_kind"]]}
    if guided is not None:
        checked["guided_decoding"] = GuidedDecodingParams(**guided)
    try:
        return SamplingParams(**checked), plain
    except (ValueError, TypeError) as error:
        raise RequestError(f"{source}: {error}") from None


def sequences(fields: Mapping[str, Any]) -> int:
    """The sequences a request's engine runs for it: `n`, or `best_of` when larger (vLLM's
    SamplingParams then runs best_of and returns the best n)."""
    return max(fields.get("n") or 1, fields.get("best_of") or 1)


def check_max_tokens(max_tokens: int, where: str) -> None:
    """A request must ask for at least one token; `where` names the input or field for the error."""
    if max_tokens < 1:
        raise RequestError(f"{where} must be >= 1, got {max_tokens}")


# Read beside the sampling fields, from wherever they come: engine outputs per streamed response.
STREAM_INTERVAL_FIELD = "stream_interval"


def sampling_fields(inputs: Mapping[str, np.ndarray], parameters_json: str | None) -> tuple[dict[str, Any], str]:
    """The request's sampling fields and where they came from, by Triton's vLLM backend's rule.

    The `sampling_parameters` input wins outright: request parameters are then not sampling
    fields at all (not merged, not checked). Without it, the request parameters are the sampling
    fields, less the keys Triton and its clients use for themselves.
    """
    if SAMPLING_TENSOR in inputs:
        text = string_input(SAMPLING_TENSOR, inputs[SAMPLING_TENSOR])
        return parse_sampling_fields(text, f"input '{SAMPLING_TENSOR}'"), SAMPLING_TENSOR
    fields = parse_sampling_fields(parameters_json, "request parameters")
    fields = {k: v for k, v in fields.items() if k not in TRITON_RESERVED_PARAMETERS and not k.startswith("triton_")}
    return fields, REQUEST_PARAMETERS


def _check_ranges(kwargs: dict[str, Any], model: ModelLimits, source: str = "sampling_parameters") -> None:
    limits = model.limits
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is not None:
        check_max_tokens(max_tokens, f"{source}.max_tokens")
    if limits.max_tokens:
        if max_tokens is None:
            # vLLM's default (16) must not exceed a smaller configured limit either.
            kwargs["max_tokens"] = min(16, limits.max_tokens)
        elif max_tokens > limits.max_tokens:
            raise RequestError(f"{source}.max_tokens={max_tokens} exceeds this model's limit of {limits.max_tokens}")
    for name in ("n", "best_of"):
        value = kwargs.get(name)
        if value is not None and not 1 <= value <= limits.max_n:
            raise RequestError(f"{source}.{name} must be between 1 and {limits.max_n}, got {value}")
    seed = kwargs.get("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise RequestError(f"{source}.seed must be between 0 and {MAX_SEED}, got {seed}")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        _check_vocabulary(f"{source}.{name}", kwargs.get(name) or (), model.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = kwargs.get(name)
        if value is not None and not 0 <= value <= 20:
            raise RequestError(f"{source}.{name} must be between 0 and 20, got {value}")


def _check_vocabulary(where: str, tokens: Iterable[int], vocab_size: int) -> None:
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise RequestError(f"{where}: token id {token} is outside the vocabulary (0..{vocab_size - 1})")


def decode_request(
    inputs: Mapping[str, np.ndarray],
    parameters_json: str | None,
    model: ModelLimits,
    encode: Callable[[str], list[int]] | None,
    decode: Callable[[list[int]], str] | None,
    outputs: frozenset[str] | None = None,
) -> GenerationRequest | EmbeddingRequest:
    """Triton inputs (name → array) and request parameters (JSON) → a validated request; `outputs`:
    the outputs the client asked for (None: all). Without `encode`/`decode` (a V1 model: its
    tokenizer is in the V1 environment) a text prompt goes to the engine as text, which tokenizes
    it and checks its length (in these words: engine/events.py). A request with `embedding_request`
    is an embedding request, any other a generation request: each only where the model serves it."""
    # Images have limits of their own (max_image_bytes each, limit_mm_per_prompt of them).
    size = sum(_payload_bytes(array) for name, array in inputs.items() if name != IMAGE_INPUT)
    if size > model.limits.max_request_bytes:
        raise RequestError(
            f"request inputs are {size} bytes, over this model's limit of {model.limits.max_request_bytes}"
        )
    task = EMBED_TASK if EMBEDDING_REQUEST in inputs else GENERATE_TASK
    if task not in model.tasks:
        raise RequestError(
            unsupported_task_message(model.served_name, task),
            log_detail=f"{model.served_name} serves {' and '.join(model.tasks)} requests; an '{EMBED_TASK}' "
            f"request is one with the input '{EMBEDDING_REQUEST}'",
        )
    try:
        tap = tap_address(parameters_json)
    except TapRequestError as error:
        raise RequestError(str(error)) from None
    if task == EMBED_TASK:
        if tap is not None:
            raise RequestError(f"an embedding request has one response: '{TAP_SOCKET_PARAMETER}' is for generation")
        return decode_embedding_request(inputs, model, encode, outputs)
    images: tuple[bytes, ...] = ()
    if IMAGE_INPUT in inputs:
        try:
            images = read_images(
                inputs[IMAGE_INPUT],
                model.images_per_prompt,
                model.model_name,
                model.limits.max_image_bytes,
                model.limits.max_image_pixels,
            )
        except ImageError as error:
            raise RequestError(str(error)) from None
    has_text = "text_input" in inputs
    has_ids = "input_ids" in inputs
    if has_text == has_ids:
        raise RequestError(
            "exactly one of 'text_input' or 'input_ids' is required" + (", not both" if has_text else "")
        )
    prompt_text: str | None = None
    if has_text:
        prompt_text = string_input("text_input", inputs["text_input"])
        if not prompt_text:
            raise RequestError("the prompt has no tokens: 'text_input' is empty")
        prompt_ids = [] if encode is None else encode(prompt_text)
    else:
        array = inputs["input_ids"]
        if array.dtype.kind not in "iu":
            raise RequestError(f"input 'input_ids' must be INT32, got {array.dtype}")
        prompt_ids = [int(x) for x in array.reshape(-1)]
        _check_vocabulary("input 'input_ids'", prompt_ids, model.vocab_size)
    engine_tokenizes = has_text and encode is None
    if not prompt_ids and not engine_tokenizes:
        raise RequestError(EMPTY_PROMPT_MESSAGE)
    limit = prompt_limit(model.max_model_len, model.limits.max_prompt_tokens)
    if len(prompt_ids) > limit:
        raise RequestError(prompt_too_long_message(len(prompt_ids), limit))

    flags = {name: _bool_input(name, inputs.get(name)) for name in BOOL_INPUTS}
    stream = bool(flags["stream"])
    exclude = flags["exclude_input_in_output"]
    if exclude is None:
        # As in Triton's vLLM backend: the prompt is prepended unless streaming; token-id
        # prompts (ensembles) never get their prompt back unless they ask.
        exclude = stream or has_ids
    if stream and not exclude:
        raise RequestError(
            STREAM_WITH_PROMPT_MESSAGE,
            log_detail="set input 'exclude_input_in_output' to true or leave it out when 'stream' is true",
        )

    fields, source = sampling_fields(inputs, parameters_json)
    interval = _stream_interval(fields.pop(STREAM_INTERVAL_FIELD, None), source)
    adapter = adapter_for(fields.pop(LORA_NAME_FIELD, None), model.adapters, source)
    priority = request_priority(inputs.get(PRIORITY), fields.pop(PRIORITY_FIELD, None), source, model)
    params, plain_sampling = sampling_params(fields, stream, model, source)
    if not exclude and prompt_text is None:
        if decode is None:
            raise RequestError(
                f"{model.model_name} runs on vLLM's V1 engine, whose tokenizer is in its own environment: "
                "'exclude_input_in_output': false needs the prompt as 'text_input', not 'input_ids'"
            )
        prompt_text = decode(prompt_ids)
    returns = ReturnFlags(**{name.removeprefix("return_"): bool(flags[name]) for name in RETURN_FLAGS})
    if returns.detokenization_window and sequences(plain_sampling) > 1:
        raise RequestError("return_detokenization_window supports one completion per request (n=1)")
    if returns.detokenization_window and decode is None:
        raise RequestError(
            f"{model.model_name} runs on vLLM's V1 engine: return_detokenization_window (the postprocessing "
            "stage's windows) is not served on V1, whose text_output is each step's exact text already: map "
            "it to the ensemble's text_output instead of a postprocessing stage (docs/ensemble.md)"
        )
    return GenerationRequest(
        prompt_token_ids=prompt_ids,
        sampling_params=params,
        stream=stream,
        prompt_text=prompt_text,
        prepend_prompt=not exclude,
        returns=returns,
        context_ids=list(prompt_ids) if returns.detokenization_window else None,
        stream_interval=interval,
        outputs=outputs,
        adapter=adapter,
        images=images,
        sampling=plain_sampling,
        sampling_source=source,
        priority=priority,
        tap=tap,
    )


# An embedding request's inputs besides `embedding_request`: an empty `text_input` (Triton's OpenAI
# front end's clients may send one), the token counts, the priority; any other BOOL input only false.
EMBEDDING_COMPANIONS = (TEXT_INPUT, RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS, PRIORITY)
EMBEDDING_FIELDS = (EMBEDDING_INPUT_FIELD, POOLING_PARAMS_FIELD)
POOLING_FIELDS = (DIMENSIONS_FIELD,)


def decode_embedding_request(
    inputs: Mapping[str, np.ndarray],
    model: ModelLimits,
    encode: Callable[[str], list[int]] | None,
    outputs: frozenset[str] | None = None,
) -> EmbeddingRequest:
    """`embedding_request` (Triton's vLLM backend's JSON: {"input": text or token ids, "pooling_params":
    {"dimensions": [N]}}) → a validated embedding request; every error names the field or input."""
    for name, array in inputs.items():
        if name == EMBEDDING_REQUEST or name in EMBEDDING_COMPANIONS:
            continue
        if name in BOOL_INPUTS and _bool_input(name, array) is False:
            continue  # asks for nothing
        raise RequestError(
            f"input '{name}' does not apply to an embedding request (one with '{EMBEDDING_REQUEST}'): it takes "
            f"'{EMBEDDING_REQUEST}', '{RETURN_NUM_INPUT_TOKENS}', '{RETURN_NUM_OUTPUT_TOKENS}' and '{PRIORITY}'"
        )
    if TEXT_INPUT in inputs and string_input(TEXT_INPUT, inputs[TEXT_INPUT]):
        raise RequestError(
            f"input '{TEXT_INPUT}' and '{EMBEDDING_REQUEST}' both hold a prompt: give the text as "
            f"{EMBEDDING_REQUEST}.{EMBEDDING_INPUT_FIELD} (an empty '{TEXT_INPUT}' is accepted)"
        )
    text = string_input(EMBEDDING_REQUEST, inputs[EMBEDDING_REQUEST])
    body = _json_loads(text, f"input '{EMBEDDING_REQUEST}' is not valid JSON")
    body = _object_of(
        body, f"input '{EMBEDDING_REQUEST}'", EMBEDDING_REQUEST, EMBEDDING_FIELDS, "a field of an embedding request"
    )
    prompt_ids, prompt_text = _embedding_prompt(body.get(EMBEDDING_INPUT_FIELD), model, encode)
    flags = {
        name: bool(_bool_input(name, inputs.get(name))) for name in (RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS)
    }
    return EmbeddingRequest(
        prompt_token_ids=prompt_ids,
        pooling=_pooling_fields(body.get(POOLING_PARAMS_FIELD)),
        prompt_text=prompt_text,
        returns=ReturnFlags(
            num_input_tokens=flags[RETURN_NUM_INPUT_TOKENS], num_output_tokens=flags[RETURN_NUM_OUTPUT_TOKENS]
        ),
        outputs=outputs,
        priority=request_priority(inputs.get(PRIORITY), None, EMBEDDING_REQUEST, model),
    )


def _object_of(value: Any, name: str, prefix: str, fields: Sequence[str], what: str) -> dict[str, Any]:
    """A parsed JSON value that must be an object of only `fields`; errors name it (`name`) or the
    first unknown field (`<prefix>.<field> is not <what>`)."""
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be a JSON object, got {_json_type(value)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise RequestError(f"{prefix}.{unknown[0]} is not {what} ({', '.join(fields)})")
    return value


def _embedding_prompt(
    value: Any, model: ModelLimits, encode: Callable[[str], list[int]] | None
) -> tuple[list[int], str | None]:
    """An embedding request's `input`: (its token ids, None), or ([], the text) for an engine that
    tokenizes it itself; checked against the vocabulary and the prompt limit."""
    where = f"{EMBEDDING_REQUEST}.{EMBEDDING_INPUT_FIELD}"
    if value is None:
        raise RequestError(f"{where} is required: the text (a string) or its token ids (a list of integers)")
    if isinstance(value, str):
        if not value:
            raise RequestError(f"the prompt has no tokens: {where} is empty")
        if encode is None:
            return [], value
        ids = encode(value)
    elif isinstance(value, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in value):
        if not value:
            raise RequestError(f"the prompt has no tokens: {where} is empty")
        ids = list(value)
        _check_vocabulary(where, ids, model.vocab_size)
    else:
        raise RequestError(
            f"{where} must be a string or a list of token ids (one input per request), got {_json_type(value)}"
        )
    limit = prompt_limit(model.max_model_len, model.limits.max_prompt_tokens)
    if len(ids) > limit:
        raise RequestError(prompt_too_long_message(len(ids), limit))
    return ids, None


def _pooling_fields(value: Any) -> dict[str, Any]:
    """`pooling_params` → vLLM's PoolingParams fields: `dimensions` an integer >= 1, or a list of one
    (Triton's OpenAI front end sends `[N]`). Whether the model can shorten its vector is the engine's call."""
    where = f"{EMBEDDING_REQUEST}.{POOLING_PARAMS_FIELD}"
    if value is None:
        return {}
    value = _object_of(value, where, where, POOLING_FIELDS, "a pooling parameter this backend takes")
    dimensions = value.get(DIMENSIONS_FIELD)
    if dimensions is None:
        return {}
    if isinstance(dimensions, list) and len(dimensions) == 1:
        dimensions = dimensions[0]
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
        raise RequestError(f"{where}.{DIMENSIONS_FIELD} must be an integer >= 1 (or a list of one), got {dimensions!r}")
    return {DIMENSIONS_FIELD: dimensions}


def completions_asked(request: GenerationRequest | EmbeddingRequest) -> int:
    """Completions the client asked for (the `n` sampling parameter; with best_of > n, vLLM's
    SamplingParams keeps the client's n in _real_n); an embedding request's one vector counts as one."""
    if isinstance(request, EmbeddingRequest):
        return 1
    return request.sampling.get("n") or 1


def engine_request(request: GenerationRequest | EmbeddingRequest, request_id: str) -> EngineRequest:
    """What the engine gets for a decoded request: plain values only (engine/events.EngineRequest)."""
    if isinstance(request, EmbeddingRequest):
        return EngineRequest(
            request_id,
            tuple(request.prompt_token_ids),
            prompt_text=request.prompt_text,
            priority=request.priority,
            pooling=request.pooling,
        )
    adapter = request.adapter
    return EngineRequest(
        request_id,
        tuple(request.prompt_token_ids),
        request.sampling,
        None if adapter is None else adapter.engine_value(),
        request.images,
        request.prompt_text if not request.prompt_token_ids else None,
        request.priority,
        sampling_source=request.sampling_source,
    )


def adapter_for(lora_name: Any, adapters: Sequence[Adapter] | None, source: str) -> Adapter | None:
    """The adapter a request's `lora_name` asks for (None: the base model). Refused with Triton's vLLM
    backend's messages: LoRA off, or a name its multi_lora.json does not have."""
    if lora_name is None:
        return None
    if adapters is None:
        raise RequestError(LORA_OFF_MESSAGE)
    if not isinstance(lora_name, str):
        raise RequestError(f"{source}.{LORA_NAME_FIELD} must be a string, got {_json_type(lora_name)}")
    for adapter in adapters:
        if adapter.name == lora_name:
            return adapter
    supported = [adapter.name for adapter in adapters]
    raise RequestError(f"LoRA {lora_name} is not supported, we currently support {supported}")


INT32_RANGE = (-(2**31), 2**31 - 1)


def request_priority(tensor: np.ndarray | None, field_value: Any, source: str, model: ModelLimits) -> int:
    """The request's priority: the `priority` input (INT32), or the sampling field of that name (an
    integer), 0 if neither; both given must agree. A non-zero priority needs the priority policy."""
    given: dict[str, int] = {}
    if tensor is not None:
        if tensor.dtype.kind not in "iu":
            raise RequestError(f"input '{PRIORITY}' must be INT32, got {tensor.dtype}")
        given[f"input '{PRIORITY}'"] = int(_scalar(PRIORITY, tensor))
    if field_value is not None:
        if isinstance(field_value, str) and field_value.strip().lstrip("-").isdigit():
            field_value = int(field_value)  # numbers as strings, as for the other integer fields
        if not isinstance(field_value, int) or isinstance(field_value, bool):
            raise RequestError(f"{source}.{PRIORITY_FIELD} must be an integer, got {_json_type(field_value)}")
        given[f"{source}.{PRIORITY_FIELD}"] = field_value
    if not given:
        return 0
    if len(set(given.values())) > 1:
        (first, one), (second, other) = given.items()
        raise RequestError(f"{first} ({one}) and {second} ({other}) disagree: give the priority once")
    (where, priority), *_ = given.items()
    if not INT32_RANGE[0] <= priority <= INT32_RANGE[1]:
        raise RequestError(f"{where} must fit in INT32, got {priority}")
    if priority and model.scheduling_policy != "priority":
        raise RequestError(
            f"{where} is {priority}, but this model schedules first come, first served: set model.json "
            f"'scheduling_policy' to \"priority\" to use priorities (it is {model.scheduling_policy!r})"
        )
    return priority


def _stream_interval(value: Any, source: str) -> int | None:
    """A request's own `stream_interval` (beside the sampling fields; not a vLLM SamplingParams field)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # KServe request parameters may carry numbers as strings
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_STREAM_INTERVAL:
        raise RequestError(
            f"{source}.{STREAM_INTERVAL_FIELD} must be an integer between 1 and {MAX_STREAM_INTERVAL}, got {value!r}"
        )
    return value


def encode_response(
    output: EngineOutput,
    request: GenerationRequest | EmbeddingRequest,
    first: bool,
    window_decode: Callable[[Sequence[int], int], str] | None = None,
) -> dict[str, np.ndarray]:
    """One engine output (a delta when streaming, the whole result otherwise) → output arrays, only
    those the request asked for (`request.outputs`: Triton passes on no other, so building them is
    wasted per response).

    Arrays hold one element per completion (index = position), as in Triton's vLLM backend;
    `output_ids` is the completions' token ids back to back, split by `num_output_tokens`.
    """
    if isinstance(request, EmbeddingRequest):
        return encode_embedding(output, request)
    completions = output.outputs
    arrays: dict[str, np.ndarray] = {}
    if request.wants("text_output"):
        prefix = request.prompt_text if (first and request.prepend_prompt and request.prompt_text) else ""
        arrays["text_output"] = np.array([(prefix + c.text).encode("utf-8") for c in completions], dtype=np.object_)
    if request.wants("output_ids"):
        arrays["output_ids"] = np.fromiter((t for c in completions for t in c.token_ids), dtype=np.int32)
    returns = request.returns
    if returns.finish_reason and request.wants("finish_reason"):
        arrays["finish_reason"] = np.array([str(c.finish_reason).encode() for c in completions], dtype=np.object_)
    if returns.cumulative_logprob and request.wants("cumulative_logprob"):
        arrays["cumulative_logprob"] = np.array(
            [c.cumulative_logprob if c.cumulative_logprob is not None else math.nan for c in completions],
            dtype=np.float32,
        )
    if returns.logprobs and request.wants("logprobs"):
        arrays["logprobs"] = np.array([_logprobs_json(c.logprobs) for c in completions], dtype=np.object_)
    if returns.num_input_tokens and request.wants("num_input_tokens"):
        arrays["num_input_tokens"] = np.array([request.prompt_tokens], dtype=np.uint32)
    if returns.num_output_tokens and request.wants("num_output_tokens"):
        arrays["num_output_tokens"] = np.array([len(c.token_ids) for c in completions], dtype=np.uint32)
    if output.prompt_logprobs is not None and request.wants(PROMPT_LOGPROBS):
        arrays[PROMPT_LOGPROBS] = np.array([_logprobs_json(output.prompt_logprobs)], dtype=np.object_)
    if returns.perf_metrics and output.finished:
        arrays.update(_perf_metrics(output.times, request))
    if request.context_ids is not None and window_decode is not None:
        # The context grows with every output even when this response carries no window.
        completion = completions[0]
        request.context_ids.extend(completion.token_ids)
        if request.wants("window_ids") or request.wants("window_offsets"):
            window = text_window(
                request.context_ids,
                len(request.prompt_token_ids),
                len(completion.token_ids),
                completion.text,
                window_decode,
            )
            arrays["window_ids"] = np.array(window.ids, dtype=np.int32)
            arrays["window_offsets"] = np.array([window.context, window.start, window.end], dtype=np.int32)
    return arrays


def encode_embedding(output: EngineOutput, request: EmbeddingRequest) -> dict[str, np.ndarray]:
    """An embedding request's one response, as Triton's vLLM backend sends it: `text_output` the JSON list
    of the vector's floats; `num_input_tokens` the prompt's, `num_output_tokens` 0, when asked."""
    arrays: dict[str, np.ndarray] = {}
    if request.wants("text_output"):
        arrays["text_output"] = np.array([json.dumps(output.embedding).encode()], dtype=np.object_)
    if request.returns.num_input_tokens and request.wants("num_input_tokens"):
        arrays["num_input_tokens"] = np.array([request.prompt_tokens], dtype=np.uint32)
    if request.returns.num_output_tokens and request.wants("num_output_tokens"):
        arrays["num_output_tokens"] = np.array([0], dtype=np.uint32)
    return arrays


def _perf_metrics(times: RequestTimes | None, request: GenerationRequest) -> dict[str, np.ndarray]:
    """return_perf_metrics' outputs for a finished request: its engine's timings in Unix-epoch
    nanoseconds (-1 where the engine has none) and its prompt tokens found in the prefix cache."""
    arrays: dict[str, np.ndarray] = {}
    seconds = (None,) * len(PERF_TIME_OUTPUTS) if times is None else times[: len(PERF_TIME_OUTPUTS)]
    for name, value in zip(PERF_TIME_OUTPUTS, seconds, strict=True):
        if request.wants(name):
            arrays[name] = np.array([-1 if value is None else round(value * 1e9)], dtype=np.int64)
    if request.wants(NUM_CACHED_TOKENS):
        arrays[NUM_CACHED_TOKENS] = np.array([0 if times is None else times.num_cached_tokens], dtype=np.uint32)
    return arrays


def _logprobs_json(logprobs: Sequence[dict[int, TokenLogprob] | None] | None) -> bytes:
    """Per position {token id: {logprob, rank, decoded_token}}; null where there is none (the first
    prompt token's)."""
    if logprobs is None:
        return b"null"
    return json.dumps(
        [
            None
            if step is None
            else {
                str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for token, lp in step.items()
            }
            for step in logprobs
        ]
    ).encode()
