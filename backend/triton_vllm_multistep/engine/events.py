"""What crosses from the engine thread to the stub: typed events, no vLLM import.

Owns the boundary types (a step's outputs, a failed request, a dead engine, KV-cache counts);
must not import vLLM or torch, so stub-side modules and unit tests can use them cheaply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

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


@dataclass(frozen=True)
class EngineFacts:
    """What the stub needs to know of the built engine (also sent by an engine process)."""

    model: str
    dtype: str  # e.g. "torch.float32"
    device_type: str  # "cpu", "cuda", ...
    vocab_size: int
    max_model_len: int
    multimodal: bool
    num_scheduler_steps: int
    attention_kernels: str  # engine.cpu_attention.attention_kernels()


EngineEvent = StepOutputs | RequestFailed | EngineDied
