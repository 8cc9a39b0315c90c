"""What crosses between the stub and the engine (thread or process): typed plain values, no vLLM import.

Owns the boundary types (the request the stub submits, a step's outputs, a failed request, a dead
engine, KV-cache counts, the built engine's facts, the build failures that cross as themselves) and
the surface the stub drives an engine through (EngineRunner); must not import vLLM, torch or numpy,
so stub-side modules and unit tests can use them cheaply, and so an engine process can run another
Python with another vLLM: nothing of vLLM's crosses in either direction (engine/admission.py builds
vLLM's request objects from an EngineRequest, engine/outputs.py turns vLLM's outputs into these).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from triton_vllm_multistep.interface import GENERATE_TASK, SAMPLING_PARAMETERS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    """One request, as the stub submits it (stub/codec.py builds it) and as it crosses to an engine process.

    `sampling` maps vLLM SamplingParams field names to JSON values: `guided_decoding` as the object
    of its GuidedDecodingParams fields, `output_kind` as a RequestOutputKind name ("DELTA",
    "FINAL_ONLY"; absent: vLLM's default), `logit_bias` keyed by token ids written as strings.
    `adapter` is the LoRA adapter as (name, lora_int_id, path) (None: the base model); `images` are
    the encoded image files the prompt's placeholders stand for, in order (checked by the stub,
    decoded again by the engine). Never modified once built.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Mapping[str, Any] = field(default_factory=dict)
    adapter: tuple[str, int, str] | None = None
    images: tuple[bytes, ...] = ()
    # A text prompt the engine tokenizes itself (`prompt_token_ids` empty): a V1 model's, whose
    # tokenizer lives in the V1 environment only (engine_v1/process.py checks its length).
    prompt_text: str | None = None
    priority: int = 0  # vLLM's request priority (lower first; only with scheduling_policy "priority")
    # An embedding request: vLLM's PoolingParams fields as JSON values (`sampling` is then empty and
    # the engine pools the prompt instead of generating); None: a generation request.
    pooling: Mapping[str, Any] | None = None
    # Where `sampling` came from (the input 'sampling_parameters' or the request 'parameters'), for
    # an engine's refusal of it in the words the stub's own checks use ("<source>: <vLLM's error>").
    sampling_source: str = SAMPLING_PARAMETERS


EMPTY_PROMPT_MESSAGE = "the prompt has no tokens: 'text_input' or 'input_ids' is empty"


def prompt_limit(max_model_len: int, max_prompt_tokens: int) -> int:
    """The most prompt tokens a model takes: max_model_len, or config.pbtxt max_prompt_tokens if lower."""
    return min(max_model_len, max_prompt_tokens) if max_prompt_tokens else max_model_len


def token_ids_of(tokenizer: Any, model_vocab_size: int) -> int:
    """How many token ids a request may name (input_ids, logit_bias): the model's and the tokenizer's
    both, whichever side has the tokenizer (the stub's, or a V1 engine process's). The tokenizer's
    figure is vLLM's `max_token_id` + 1, computed as vLLM 0.8.5's cached tokenizer computes it for a
    tokenizer transformers loaded (stub/model_tokenizer.py): the largest id of the vocabulary, or the
    tokenizer's `vocab_size` where that is larger (vLLM's words: some count special tokens there only)."""
    max_token_id = getattr(tokenizer, "max_token_id", None)
    if max_token_id is None:
        max_token_id = max(tokenizer.get_vocab().values())
        with contextlib.suppress(NotImplementedError, AttributeError):
            max_token_id = max(max_token_id, tokenizer.vocab_size)
    return min(model_vocab_size, int(max_token_id) + 1)


def prompt_too_long_message(tokens: int, limit: int) -> str:
    """A prompt over the model's limit (max_model_len, or config.pbtxt max_prompt_tokens if lower),
    in the same words whichever side tokenized it (the stub, or a V1 engine process)."""
    return f"the prompt has {tokens} tokens, more than this model's limit of {limit}"


class TokenLogprob(NamedTuple):
    """One candidate token's log probability at one position (vLLM's Logprob, as plain values)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Completion(NamedTuple):
    """One completion of a request in one engine output (vLLM's CompletionOutput, as plain values).

    Under the request's output kind: a delta (the new token ids and text of the step(s)) or all
    so far; `logprobs` per token of `token_ids` (None unless asked for).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, TokenLogprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestTimes(NamedTuple):
    """One finished request's timings and prefix-cache use, as its engine kept them (vLLM's
    RequestMetrics on V0; RequestStateStats on V1, its engine core's monotonic stamps moved to the
    wall clock): seconds since the Unix epoch (time.time()), None where the engine has none."""

    arrival_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's num_cached_tokens)


class EngineOutput(NamedTuple):
    """One request's output of one engine step (vLLM's RequestOutput, as the plain values the stub uses).

    Tuples, not dataclasses: hundreds are built per second per stream and cross the process pipe.
    """

    request_id: str
    outputs: list[Completion]
    finished: bool
    # The prompt's length as the engine counts it (image placeholders expanded); a delta carries it
    # in the request's first output only (None in the others, as vLLM's prompt_token_ids).
    prompt_tokens: int | None = None
    # time.time() of the request's first token (vLLM's RequestMetrics), once there is one.
    first_token_time: float | None = None
    # The request's timings and cache use: in its finished output only (None in the others).
    times: RequestTimes | None = None
    # With `prompt_logprobs` asked: per prompt token (None for the first, as vLLM) its candidates,
    # in the request's first output only.
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None
    # An embedding request's result (vLLM's PoolingOutput data as floats): its one, finished output,
    # with no completions.
    embedding: list[float] | None = None


@dataclass(frozen=True)
class StepOutputs:
    """The outputs one `step()` returned (one pythonized decode step, or one window).

    With step timing on (metrics), steps that return nothing are handed over too (empty
    `outputs`), and `forward_seconds` / `forward_end` (perf_counter) describe the model's
    forward passes in the step (None where they are not measured: GPU hosts, see
    engine.loop.module_hooks_time_the_forward_pass); `new_window` says the step started a
    scheduling round.
    """

    outputs: list[EngineOutput]
    step_seconds: float
    finished_at: float = field(default_factory=time.monotonic)
    forward_seconds: float | None = 0.0
    forward_end: float | None = None
    new_window: bool = False
    # Finished best_of requests: request id → (tokens, sequences) of candidates not returned.
    unreturned: dict[str, tuple[int, int]] = field(default_factory=dict)
    # vllm:iteration_tokens_total's sample: the tokens this step put through the model, prompt tokens
    # prefilled plus one per sequence decoded (None: not known); and requests it preempted.
    iteration_tokens: int | None = None
    preemptions: int = 0


@dataclass(frozen=True)
class RequestFailed:
    """The engine refused or lost one request."""

    request_id: str
    message: str


@dataclass(frozen=True)
class EngineDied:
    """The engine raised from `step()`; every request in it is lost."""

    message: str
    request_ids: list[str]


@dataclass(frozen=True)
class KvCacheStats:
    """Block counts of the engine's KV cache (device blocks; CPU memory on CPU)."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    # Share of looked-up blocks found in the prefix cache since start (vLLM's figure); -1 when off.
    prefix_cache_hit_rate: float = -1.0
    # LoRA adapter names of the running and the waiting requests, each once, comma-joined in the order
    # vLLM V0's stats list them (the labels of its vllm:lora_requests_info).
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""


@dataclass(frozen=True)
class EngineFacts:
    """What the stub needs to know of the built engine (also sent by an engine process)."""

    model: str
    vocab_size: int
    max_model_len: int
    multimodal: bool
    num_scheduler_steps: int
    attention_kernels: str  # engine.cpu_attention.attention_kernels()
    max_loras: int = 0  # LoRA adapters a batch may hold (vLLM's max_loras); 0: LoRA off
    images_per_prompt: int = 0  # vLLM's limit_mm_per_prompt for images; 0: the model takes none
    async_scheduling: bool = False  # V1 schedules the next step while this one runs
    scheduling_policy: str = "fcfs"  # vLLM's scheduler policy: "fcfs" or "priority"
    # vLLM's CacheConfig.metrics_info() (field → text): the labels of vllm:cache_config_info.
    cache_config: tuple[tuple[str, str], ...] = ()
    # What requests the model serves: GENERATE_TASK, EMBED_TASK or both (vLLM's task names).
    tasks: tuple[str, ...] = (GENERATE_TASK,)


EngineEvent = StepOutputs | RequestFailed | EngineDied


class EngineBuildError(ValueError):
    """The engine arguments ask for something this backend cannot run; the message says what.

    Defined here (raised by engine/factory.py) so that an engine process's build failure crosses to
    the stub as itself without vLLM.
    """


def load_adapters_once(
    adapters: Sequence[tuple[str, int, str]], add_lora: Callable[[str, int, str], Any], shutdown: Callable[[], Any]
) -> None:
    """multi_lora.json's adapters (name, lora_int_id, path) loaded once at the model's start by the
    engine's own `add_lora`, as vLLM loads one for a request: the first one vLLM refuses shuts the
    engine down (`shutdown`) and is the model's load error naming it, in one wording for both engines
    (engine/warmup.py, engine_v1/process.py each pass their vLLM's calls)."""
    for name, lora_int_id, path in adapters:
        try:
            add_lora(name, lora_int_id, path)
        except Exception as error:
            shutdown()
            raise EngineBuildError(
                f"LoRA adapter {name!r} ({path}) cannot be loaded by vLLM: {type(error).__name__}: {error}"
            ) from None
    if adapters:
        logger.info("LoRA adapters checked: %s", ", ".join(name for name, _, _ in adapters))


class EngineWarmupError(RuntimeError):
    """The engine failed its warm-up generation: a first request would have failed the same way
    (raised by engine/warmup.py; defined here for the reason EngineBuildError is)."""


class EngineRunner(Protocol):
    """What the stub drives: engine.loop.EngineLoop (the engine in a thread of the stub) or
    engine.process.EngineProcess (the engine in a process of its own); same events, same order."""

    error: str | None  # why the engine failed, once it has
    torch_threads: int | None  # what the engine runs with, once built

    @property
    def healthy(self) -> bool: ...

    @property
    def facts(self) -> EngineFacts: ...

    def start_engine(self) -> object: ...

    def serve(
        self,
        sink: Callable[[EngineEvent], None],
        on_state: Callable[[KvCacheStats], None] | None = None,
        state_interval: float = 0.25,
        time_steps: bool = False,
    ) -> None: ...

    def submit(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...

    def shutdown(self) -> None: ...
