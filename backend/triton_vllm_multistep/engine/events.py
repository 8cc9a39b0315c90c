"""What crosses from the engine (thread or process) to the stub: typed events, no vLLM import.

Owns the boundary types (a step's outputs, a failed request, a dead engine, KV-cache counts, the
built engine's facts) and the surface the stub drives an engine through (EngineRunner); must not
import vLLM or torch, so stub-side modules and unit tests can use them cheaply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# How a multi-step engine hands out tokens: after every decoded step, or once per scheduling
# window. The name and values of the `stream_mode` config.pbtxt parameter (vLLM's own name for
# it is `multi_step_stream_outputs`, True for "step").
StreamMode = Literal["step", "window"]
STREAM_MODES: tuple[StreamMode, ...] = ("step", "window")


@dataclass(frozen=True)
class StepOutputs:
    """The outputs one `step()` returned (one pythonized decode step, or one window).

    With step timing on (metrics), steps that return nothing are handed over too (empty
    `outputs`), and `forward_seconds` / `forward_end` (perf_counter) describe the model's
    forward passes in the step (None where they are not measured: GPU hosts, see
    engine.loop.module_hooks_time_the_forward_pass); `new_window` says the step started a
    scheduling round.
    """

    outputs: list[Any]  # vLLM RequestOutputs
    step_seconds: float
    finished_at: float = field(default_factory=time.monotonic)
    forward_seconds: float | None = 0.0
    forward_end: float | None = None
    new_window: bool = False
    # Finished best_of requests: request id → (tokens, sequences) of candidates not returned.
    unreturned: dict[str, tuple[int, int]] = field(default_factory=dict)


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


EngineEvent = StepOutputs | RequestFailed | EngineDied


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

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        lora_request: Any = None,
        images: Sequence[Any] = (),
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...

    def shutdown(self) -> None: ...
