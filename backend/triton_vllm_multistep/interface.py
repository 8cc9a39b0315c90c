"""The LLM model's wire contract: its tensors (names, Triton types, dims), the return flags, the
`image` encoding, the `lora_name` field, the ensemble stages' tensors, and the words clients match on.

Owns every name that the model's clients (Triton's vLLM backend's, the OpenAI front end, the
ensemble's stages, the tools) and the stub agree on (docs/interface.md, docs/ensemble.md); must
not import vLLM, torch or numpy, nor any other module of this package: every side reads it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tensor:
    """One tensor as config.pbtxt declares it (`auto_complete_config` adds those it lacks)."""

    name: str
    data_type: str  # Triton's config type, "TYPE_STRING" ...
    dims: tuple[int, ...]
    optional: bool = True  # inputs only: outputs are sent when asked for

    def input_config(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims), "optional": self.optional}

    def output_config(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}


# --- inputs of the LLM model (as Triton's vLLM backend declares them) ---------------------------
TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"  # a JSON object of vLLM sampling fields
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
# Each element an image's file bytes (PNG, JPEG, ...) base64-encoded, as Triton's vLLM backend
# (r24.12+) takes them; a `data:...;base64,` URL is read too (encode_image writes them).
IMAGE_INPUT = "image"
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
RETURN_LOGPROBS = "return_logprobs"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_DETOKENIZATION_WINDOW = "return_detokenization_window"  # ours: the ensemble's postprocessing asks
# The request's timings and prefix-cache use on its FINAL response (TensorRT-LLM's backend's flag and names).
RETURN_PERF_METRICS = "return_perf_metrics"
# The request's scheduling priority (INT32 [1], default 0; lower is scheduled first, as in vLLM), with
# model.json scheduling_policy "priority"; also a field of `sampling_parameters` (never the KServe
# request parameter of that name: Triton's own scheduler's priority).
PRIORITY = "priority"
PRIORITY_FIELD = "priority"
# An embedding model's request (Triton's vLLM backend r25.11+): a JSON object {"input": text or a list
# of token ids, "pooling_params": {"dimensions": [N]}}; one FINAL response, the embedding as the JSON
# list of its floats in `text_output`. A request with it is an 'embed' request, any other a 'generate' one.
EMBEDDING_REQUEST = "embedding_request"
EMBEDDING_INPUT_FIELD = "input"
POOLING_PARAMS_FIELD = "pooling_params"
DIMENSIONS_FIELD = "dimensions"
RETURN_FLAGS = (
    RETURN_FINISH_REASON,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_DETOKENIZATION_WINDOW,
    RETURN_PERF_METRICS,
)
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, *RETURN_FLAGS)
# A field of `sampling_parameters` (or of the request parameters without that input): the adapter
# of multi_lora.json the request runs with.
LORA_NAME_FIELD = "lora_name"

# --- outputs of the LLM model ------------------------------------------------------------------
TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
LOGPROBS = "logprobs"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
# For a stateless postprocessing model: ids to replay, and (context, start, end) in them.
WINDOW_IDS = "window_ids"
WINDOW_OFFSETS = "window_offsets"
# return_perf_metrics: Unix-epoch nanoseconds as the engine recorded them (-1 where it has none), and
# how many prompt tokens came from the prefix cache.
ARRIVAL_TIME_NS = "arrival_time_ns"
FIRST_SCHEDULED_TIME_NS = "first_scheduled_time_ns"
FIRST_TOKEN_TIME_NS = "first_token_time_ns"
LAST_TOKEN_TIME_NS = "last_token_time_ns"
PERF_TIME_OUTPUTS = (ARRIVAL_TIME_NS, FIRST_SCHEDULED_TIME_NS, FIRST_TOKEN_TIME_NS, LAST_TOKEN_TIME_NS)
NUM_CACHED_TOKENS = "num_cached_tokens"
# `prompt_logprobs` in sampling_parameters: the prompt's logprobs (JSON, as `logprobs`, null for the
# first prompt token), on the request's first response.
PROMPT_LOGPROBS = "prompt_logprobs"
PERF_METRICS_OUTPUTS = (*PERF_TIME_OUTPUTS, NUM_CACHED_TOKENS)

INPUTS = (
    Tensor(TEXT_INPUT, "TYPE_STRING", (1,)),
    Tensor(INPUT_IDS, "TYPE_INT32", (-1,)),
    Tensor(STREAM, "TYPE_BOOL", (1,)),
    Tensor(SAMPLING_PARAMETERS, "TYPE_STRING", (1,)),
    Tensor(EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", (1,)),
    *(Tensor(name, "TYPE_BOOL", (1,)) for name in RETURN_FLAGS),
    # Declared as Triton's vLLM backend does (base64 images) so its clients' configs load; a
    # text-only model refuses it per request.
    Tensor(IMAGE_INPUT, "TYPE_STRING", (-1,)),
    Tensor(PRIORITY, "TYPE_INT32", (1,)),
    Tensor(EMBEDDING_REQUEST, "TYPE_STRING", (1,)),
)
OUTPUTS = (
    Tensor(TEXT_OUTPUT, "TYPE_STRING", (-1,)),
    Tensor(OUTPUT_IDS, "TYPE_INT32", (-1,)),
    Tensor(FINISH_REASON, "TYPE_STRING", (-1,)),
    Tensor(CUMULATIVE_LOGPROB, "TYPE_FP32", (-1,)),
    Tensor(LOGPROBS, "TYPE_STRING", (-1,)),
    Tensor(NUM_INPUT_TOKENS, "TYPE_UINT32", (1,)),
    Tensor(NUM_OUTPUT_TOKENS, "TYPE_UINT32", (-1,)),
    Tensor(WINDOW_IDS, "TYPE_INT32", (-1,)),
    Tensor(WINDOW_OFFSETS, "TYPE_INT32", (3,)),
    *(Tensor(name, "TYPE_INT64", (1,)) for name in PERF_TIME_OUTPUTS),
    Tensor(NUM_CACHED_TOKENS, "TYPE_UINT32", (1,)),
    Tensor(PROMPT_LOGPROBS, "TYPE_STRING", (1,)),
)
INPUT_NAMES = tuple(tensor.name for tensor in INPUTS)
OUTPUT_NAMES = tuple(tensor.name for tensor in OUTPUTS)

# --- the ensemble's preprocessing model (TensorRT-LLM's names where the meaning is the same) ----
MESSAGES = "messages"  # a JSON list of {"role", "content"}: a chat, through the tokenizer's template
STOP_WORDS = "stop_words"
BAD_WORDS = "bad_words"
# Scalar inputs that map onto one vLLM sampling field: input name → (field name, its type).
SCALAR_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "max_tokens": ("max_tokens", int),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "random_seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "min_length": ("min_tokens", int),
}

# --- words clients match on: Triton's vLLM backend's, sent whole (their CI compares them whole) ---
# A request refused by a failed engine (the OpenAI front end answers it with HTTP 503); the engine's
# error goes to the server log.
UNHEALTHY_ENGINE_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"
# Streaming with the prompt in the output: vLLM's words after their model.py's prefix; what to do
# instead goes to the server log.
STREAM_WITH_PROMPT_MESSAGE = (
    "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
)
# A `lora_name` sent to a model without LoRA (their src/model.py `_verify_loras`).
LORA_OFF_MESSAGE = "LoRA feature is not enabled."
# What a model serves, in vLLM's task names: generation, or embeddings (an embedding model's pooling).
GENERATE_TASK = "generate"
EMBED_TASK = "embed"
SERVED_TASKS = (GENERATE_TASK, EMBED_TASK)  # every task this backend serves, on either engine


def unsupported_task_message(model_name: str, task: str) -> str:
    """An 'embed' request (one with `embedding_request`) to a generative model, or a 'generate' one (any
    other) to an embedding model: their src/model.py's words, whole."""
    return f"Error generating stream: Model {model_name} does not support '{task}' request"


def image_file(image: Any, image_format: str = "PNG") -> bytes:
    """A PIL image's file bytes (PNG: lossless): what an `EngineRequest` carries for it."""
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def decode_image(data: bytes) -> Any:
    """An image file's bytes (what an `EngineRequest` carries) → its RGB PIL image, as the stub read it;
    each engine decodes the files it is handed with this."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def encode_image(image: Any, image_format: str = "PNG") -> bytes:
    """A PIL image as an element of the `image` input: its file bytes (PNG: lossless), base64-encoded."""
    return base64.b64encode(image_file(image, image_format))
