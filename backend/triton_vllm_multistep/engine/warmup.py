"""Start-up warm-up: a short generation through the built engine, so that settings a first request
would trip on fail the model's load instead.

Owns the warm-up workload (prefill without and with a cached prefix, a request arriving inside a
running multi-step window, greedy and seeded sampling, logprobs), loading the model's LoRA adapters
once (vLLM's own checks of each, e.g. its target modules), and the load errors they raise;
must not run once the engine serves requests (it drives `step()` itself) or touch global RNG state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

from triton_vllm_multistep.engine.events import EngineWarmupError, load_adapters_once

logger = logging.getLogger(__name__)

WARMUP_TIME_BUDGET_S = 300.0
_REQUEST_PREFIX = "__vllm_multistep_warmup"


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    steps: int
    generated_tokens: int


def _token_ids(vocab_size: int, count: int, salt: int) -> list[int]:
    """Deterministic, ordinary-looking token ids (clear of the low ids that hold special tokens)."""
    span = max(vocab_size - 20, 1)
    return [20 + (salt * 131 + i * 37) % span for i in range(count)]


def _changed_settings(engine_args: EngineArgs | None) -> str:
    if engine_args is None:
        return "unknown"
    defaults = EngineArgs(model=engine_args.model)
    changed = [
        f"{f.name}={getattr(engine_args, f.name)!r}"
        for f in dataclasses.fields(EngineArgs)
        if f.name != "model" and getattr(engine_args, f.name) != getattr(defaults, f.name)
    ]
    return ", ".join(changed) or "defaults"


def _hint(error: BaseException) -> str:
    """The fix for failures whose cause is known; empty when it is not."""
    text = f"{type(error).__name__}: {error}"
    if "intel_extension_for_pytorch" in text:
        return (
            " Fix: install intel-extension-for-pytorch==2.6.0 (scripts/setup.sh does) or turn off the setting that "
            "needs it (enable_prefix_caching, a block_size other than 16)."
        )
    return ""


def warm_up(
    engine: LLMEngine, engine_args: EngineArgs | None = None, time_budget_s: float = WARMUP_TIME_BUDGET_S
) -> WarmupReport:
    """Run the warm-up workload to completion on `engine` (idle, freshly built) and return what it took.

    Raises EngineWarmupError naming the engine settings in use when the engine raises or the
    workload does not finish within `time_budget_s` (an engine that cannot serve a few dozen tokens
    in that time is not ready). Leaves the engine idle with an empty prefix cache.
    """
    started = time.perf_counter()
    model_config = engine.model_config
    if model_config.runner_type == "pooling":
        return _warm_up_pooling(engine, engine_args, time_budget_s)
    block_size = engine.cache_config.block_size
    steps = max(engine.scheduler_config.num_scheduler_steps, 1)
    max_len = model_config.max_model_len
    vocab = model_config.get_vocab_size()
    # Two full blocks of shared prefix (a prefix-cache hit is whole blocks), a short own suffix, and a
    # window and a half of decode steps; scaled down for tiny max_model_len.
    max_tokens = max(1, min(steps + steps // 2 + 1, max_len // 4))
    prefix_len = max(1, min(2 * block_size, max_len - max_tokens - 4))
    shared = _token_ids(vocab, prefix_len, salt=1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True, logprobs=1)
    first = (f"{_REQUEST_PREFIX}-first", shared + _token_ids(vocab, 3, salt=2), greedy)
    # Arrive once the first request has a decoded token: its shared blocks are computed (a cache hit
    # with prefix caching) and, with num_scheduler_steps > 1, its decode window is running.
    arrive_after_tokens = min(2, max_tokens)
    later = [
        (f"{_REQUEST_PREFIX}-shared", shared + _token_ids(vocab, 2, salt=3), greedy),
        (f"{_REQUEST_PREFIX}-seeded", _token_ids(vocab, 5, salt=4), seeded),
    ]
    request_ids = [first[0], *(r[0] for r in later)]
    num_steps = generated = 0
    try:
        engine.add_request(first[0], TokensPrompt(prompt_token_ids=first[1]), first[2])
        finished: set[str] = set()
        while engine.has_unfinished_requests() or later:
            if time.perf_counter() - started > time_budget_s:
                raise TimeoutError(f"the warm-up generation did not finish within {time_budget_s:.0f} s")
            outputs = engine.step()
            num_steps += 1
            if later and any(
                o.request_id == first[0] and len(o.outputs[0].token_ids) >= arrive_after_tokens for o in outputs
            ):
                for request_id, prompt, params in later:
                    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
                later = []
            for output in outputs:
                if output.finished:
                    finished.add(output.request_id)
                    generated += len(output.outputs[0].token_ids)
            if later and not engine.has_unfinished_requests():
                raise RuntimeError("the warm-up's first request finished before its decode started")
        missing = set(request_ids) - finished
        if missing:
            raise RuntimeError(f"warm-up requests ended without a final output: {sorted(missing)}")
    except Exception as error:
        raise _failed(engine, request_ids, "generation", error, engine_args) from error
    _forget_warmup_blocks(engine)
    report = WarmupReport(time.perf_counter() - started, num_steps, generated)
    logger.info(
        "engine warm-up: %d tokens in %d steps, %.2f s (prefill with%s a cached prefix, num_scheduler_steps=%d)",
        report.generated_tokens,
        report.steps,
        report.seconds,
        "" if engine.cache_config.enable_prefix_caching else "out",
        steps,
    )
    return report


def _failed(
    engine: LLMEngine, request_ids: list[str], workload: str, error: Exception, engine_args: EngineArgs | None
) -> EngineWarmupError:
    """The warm-up's requests aborted, and the load error saying what failed and with which settings."""
    for request_id in request_ids:
        try:
            engine.abort_request(request_id)
        except Exception:  # the engine is broken already; the load fails anyway
            pass
    return EngineWarmupError(
        f"the engine failed its start-up warm-up {workload}, so the first request would fail the same way: "
        f"{type(error).__name__}: {error}.{_hint(error)} Engine settings that differ from vLLM's defaults: "
        f"{_changed_settings(engine_args)}"
    )


def _warm_up_pooling(engine: LLMEngine, engine_args: EngineArgs | None, time_budget_s: float) -> WarmupReport:
    """An embedding model's warm-up: two prompts of different lengths pooled in one batch, each
    output checked to be one finite vector (an embedding model has no decode steps)."""
    from vllm.pooling_params import PoolingParams

    started = time.perf_counter()
    vocab = engine.model_config.get_vocab_size()
    length = max(2, min(16, engine.model_config.max_model_len))
    prompts = {f"{_REQUEST_PREFIX}-pool-{n}": _token_ids(vocab, n, salt=n) for n in (length, length // 2)}
    num_steps = 0
    try:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), PoolingParams())
        finished: set[str] = set()
        while engine.has_unfinished_requests():
            if time.perf_counter() - started > time_budget_s:
                raise TimeoutError(f"the warm-up embeddings did not finish within {time_budget_s:.0f} s")
            for output in engine.step():
                data = output.outputs.data
                if output.finished and data.dim() == 1 and bool(data.isfinite().all()):
                    finished.add(output.request_id)
            num_steps += 1
        missing = set(prompts) - finished
        if missing:
            raise RuntimeError(f"warm-up embeddings ended without a finite vector: {sorted(missing)}")
    except Exception as error:
        raise _failed(engine, list(prompts), "embeddings", error, engine_args) from error
    report = WarmupReport(time.perf_counter() - started, num_steps, 0)
    logger.info("engine warm-up: %d prompts embedded in %d steps, %.2f s", len(prompts), num_steps, report.seconds)
    return report


def _forget_warmup_blocks(engine: LLMEngine) -> None:
    """Evict the warm-up's cached blocks; vLLM's reset also zeroes the prefix-cache hit statistics,
    so the hit-rate gauge describes served requests only."""
    if engine.cache_config.enable_prefix_caching and not engine.reset_prefix_cache():
        logger.warning("the prefix cache still holds the warm-up's blocks (some were not freed)")


def warmed_up(engine: LLMEngine, engine_args: EngineArgs | None = None) -> LLMEngine:
    """`engine` after a successful warm-up; shut down (and EngineWarmupError raised) otherwise."""
    try:
        warm_up(engine, engine_args)
    except EngineWarmupError:
        engine.model_executor.shutdown()
        raise
    return engine


def preload_adapters(engine: LLMEngine, adapters: Sequence[tuple[str, int, str]]) -> LLMEngine:
    """`engine` with each LoRA adapter loaded once into its CPU cache, as vLLM loads it for a request
    (files, PEFT config, rank, target modules the model supports); EngineBuildError naming the first
    that fails, the engine shut down. The cache keeps at most max_cpu_loras: later requests reload
    evicted ones from the same, now checked, folders."""
    load_adapters_once(
        adapters, lambda *adapter: engine.add_lora(LoRARequest(*adapter)), lambda: engine.model_executor.shutdown()
    )
    return engine
