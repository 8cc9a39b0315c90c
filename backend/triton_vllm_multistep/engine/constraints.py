"""Structured output (vLLM's guided decoding) for the engine loop: each request's constraint is built
outside the engine's step, and a constraint that fails at any step fails its request alone.

Owns building a request's guided-decoding logits processor with vLLM 0.8.5's own backends
(xgrammar, outlines, lm-format-enforcer, guidance: vLLM's `get_local_guided_decoding_logits_processor`,
with vLLM's compiled-grammar caches) on a thread of its own with a tokenizer of its own, and the
guard each processor runs behind; must not drive the engine (engine/loop.py admits what is built).

Why not in the engine's step: building a constraint can take over a second (measured: xgrammar's
first JSON schema on the demo model 1.2 s, its tokenizer tables 0.3 s). On a thread of its own it
still holds the GIL while the backend compiles (a running stream's longest step gap while a
12-field schema was built: 0.78 s with xgrammar, benchmarks/constraint_build_stall.py), so this
bounds the stall to the compile itself; a process of its own would remove it. Why a guard: vLLM
calls the processors inside the model's forward step, where an exception (a backend that compiles
lazily, a grammar it cannot follow) would end the engine and every request with it; the guard
records it and leaves the logits alone, and the engine loop then aborts that request and drops
its output of the step, so nothing unconstrained reaches a client.
"""

from __future__ import annotations

import copy
import inspect
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from vllm.engine.llm_engine import LLMEngine
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# vLLM 0.8.5's xgrammar processor compiles its grammar (`_ensure_ctx`), and its guidance processor
# its matcher (`_initialize`), at their first call, inside the engine's step; the builder calls them
# first (each is idempotent and the first thing `__call__` does), so the compile runs here and a
# grammar that cannot compile fails the request before it is admitted.
LAZY_INITIALIZERS = ("_ensure_ctx", "_initialize")

# (request id, built SamplingParams) once built; (request id, error message) when it cannot be.
Built = Callable[[str, SamplingParams], None]
Refused = Callable[[str, str], None]


def add_request_past_multi_step_check(
    engine: LLMEngine, add_request: Callable[..., None], *args: Any, **kwargs: Any
) -> None:
    """Call vLLM's `add_request` for a request with guided decoding or logits processors on a
    multi-step engine whose runner applies them exactly (CPU: every step pythonized first; GPU:
    one-step windows, engine/gpu_worker.py).

    vLLM 0.8.5 refuses them when num_scheduler_steps > 1 (its GPU runner samples step k+1 before
    step k's token reaches the CPU, vLLM issue 9893). That check is its only use of
    num_scheduler_steps while admitting, so it is passed with the value it allows, on the engine
    thread (nothing schedules meanwhile).
    """
    scheduler_config = engine.scheduler_config
    steps = scheduler_config.num_scheduler_steps
    scheduler_config.num_scheduler_steps = 1
    try:
        add_request(*args, **kwargs)
    finally:
        scheduler_config.num_scheduler_steps = steps


def needs_logits_processors(params: Any) -> bool:
    """Sampling parameters that vLLM's multi-step add_request refuses."""
    return isinstance(params, SamplingParams) and bool(params.guided_decoding or params.logits_processors)


class ConstraintGuard:
    """A logits processor that records its failure instead of raising inside the engine's step."""

    def __init__(self, processor: Any, request_id: str, failures: list[tuple[str, str]]) -> None:
        self.processor = processor
        self.request_id = request_id
        self.failures = failures
        self.failed = False
        # vLLM passes (prompt ids, output ids, logits) to processors taking three arguments.
        self.takes_prompt = len(inspect.signature(processor).parameters) == 3

    def __call__(self, *args: Any) -> Any:
        logits = args[-1]
        if self.failed:
            return logits
        try:
            return self.processor(*args)
        except Exception as error:  # the request fails, not the engine
            self.failed = True
            self.failures.append(
                (self.request_id, f"guided_decoding failed while decoding: {type(error).__name__}: {error}")
            )
            return logits


def guarded_signature(guard: ConstraintGuard) -> Any:
    """The callable vLLM gets: its arity is how vLLM decides whether to pass the prompt ids."""
    if guard.takes_prompt:
        return lambda prompt_ids, output_ids, logits: guard(prompt_ids, output_ids, logits)
    return lambda output_ids, logits: guard(output_ids, logits)


class ConstraintBuilder:
    """Builds guided-decoding processors for the engine loop on a thread of its own, in order."""

    def __init__(self, engine: LLMEngine, failures: list[tuple[str, str]]) -> None:
        self._model_config = engine.model_config
        self._default_backend = engine.decoding_config.guided_decoding_backend
        self._reasoning_backend = engine.decoding_config.reasoning_backend
        self._tokenizer: Any = None  # loaded by the builder thread before its first build
        self._failures = failures
        self._work: queue.SimpleQueue[tuple[str, SamplingParams, Built, Refused] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vllm-constraint-builder", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, params: SamplingParams, built: Built, refused: Refused) -> None:
        self._work.put((request_id, params, built, refused))

    def stop(self) -> None:
        self._work.put(None)

    def build(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """`params` with its guided_decoding turned into a guarded logits processor (raises what the
        backend raises for a constraint it cannot build)."""
        from vllm.model_executor.guided_decoding import get_local_guided_decoding_logits_processor

        guided = copy.copy(params.guided_decoding)
        guided.backend = guided.backend or self._default_backend
        processor = get_local_guided_decoding_logits_processor(
            guided_params=guided,
            tokenizer=self._tokenizer,
            model_config=self._model_config,
            reasoning_backend=self._reasoning_backend,
        )
        if processor is not None:
            for name in LAZY_INITIALIZERS:
                initialize = getattr(processor, name, None)
                if callable(initialize):
                    initialize()
        built = copy.copy(params)
        built.guided_decoding = None
        processors = list(params.logits_processors or [])
        if processor is not None:
            processors.append(guarded_signature(ConstraintGuard(processor, request_id, self._failures)))
        built.logits_processors = processors
        return built

    def _load_tokenizer(self) -> Any:
        """A tokenizer of its own: the engine thread detokenizes with the engine's, and a fast
        tokenizer is not safe to share across threads."""
        from vllm.transformers_utils.tokenizer import get_tokenizer

        model = self._model_config
        return get_tokenizer(
            model.tokenizer,
            tokenizer_mode=model.tokenizer_mode,
            trust_remote_code=model.trust_remote_code,
            revision=model.tokenizer_revision,
        )

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            request_id, params, built, refused = item
            try:
                ready = self.build(request_id, params)
            except Exception as error:
                refused(request_id, f"guided_decoding cannot be built: {type(error).__name__}: {error}")
            else:
                built(request_id, ready)
