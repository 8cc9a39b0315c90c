"""Prefix caching with the CPU multi-step engine on the tiny demo model: same outputs with it on and off.

Owns the shared-prefix workload (arrivals inside a running window, an abort, preemption with cached
blocks), its comparisons, and a K/V-slot audit: every block the scheduler hands the model runner as
already computed must hold the sequence's own tokens at their positions. Must not mock vLLM or
assert on timings.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from vllm import EngineArgs, SamplingParams
from vllm.forward_context import get_forward_context
from vllm.sampling_params import RequestOutputKind
from vllm.transformers_utils.tokenizer import get_tokenizer

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.cpu_attention import ipex_available
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine
from triton_vllm_multistep.engine.loop import driver_model
from triton_vllm_multistep.engine.outputs import plain_output
from triton_vllm_multistep.engine.prefix_cache import prefix_cache_hit_rate

pytestmark = pytest.mark.skipif(not ipex_available(), reason="prefix caching on CPU needs IPEX (scripts/setup.sh)")

BLOCK_SIZE = 16
# Room for the mixed phase without caching; the preemption phase cannot fit, with or without it.
NUM_BLOCKS = 64
ABORT_AFTER_OUTPUTS = 3
LOGPROB_TOLERANCE = 5e-3
TIE_TOLERANCE = 1e-3
SYSTEM = "system: you are terse; answer in plain words, count like 1 2 3 when asked. user: "
CONFIGS = [(1, False), (1, True), (8, False), (8, True)]  # (num_scheduler_steps, enable_prefix_caching)

Request = tuple[str, str, SamplingParams]


def _mixed_requests() -> list[tuple[int, Request]]:
    """(engine step at which it arrives, request); later ones arrive inside a running window and
    share the system prompt's blocks (one repeats a whole prompt: a full prefix-cache hit)."""
    greedy = {"temperature": 0.0}
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    return [
        (0, ("greedy", SYSTEM + "hello world", SamplingParams(max_tokens=13, **greedy))),
        (0, ("seeded", SYSTEM + "the quick brown fox", SamplingParams(max_tokens=14, seed=11, **sampled))),
        (0, ("abort", SYSTEM + "bright stars in winter", SamplingParams(max_tokens=30, **greedy))),
        (3, ("late-same-prompt", SYSTEM + "hello world", SamplingParams(max_tokens=12, **greedy))),
        (3, ("late-seeded", SYSTEM + "cats sleep near warm windows", SamplingParams(max_tokens=10, seed=5, **sampled))),
        (
            5,
            (
                "late-delta",
                SYSTEM + "the quick brown fox",
                SamplingParams(max_tokens=15, output_kind=RequestOutputKind.DELTA, **greedy),
            ),
        ),
        (5, ("late-logprobs", SYSTEM + "people write code", SamplingParams(max_tokens=9, logprobs=3, **greedy))),
        (7, ("late-n2", SYSTEM + "rivers run to the sea", SamplingParams(n=2, max_tokens=9, seed=3, **sampled))),
        (
            9,
            (
                "late-penalties",
                SYSTEM + "people write code",
                SamplingParams(max_tokens=11, repetition_penalty=1.6, frequency_penalty=0.8, **greedy),
            ),
        ),
    ]


# Words that give each preemption request a prompt of its own after the shared system prompt.
FILLER = "apple river stone cloud music paper garden window bottle candle forest silver".split()


def _preemption_requests() -> list[Request]:
    """More KV cache than NUM_BLOCKS holds even with the system prompt's blocks shared (greedy, with
    the top-2 logprobs that tell a numerical tie from a wrong token). The pressure comes from long
    prompts of their own (one prefill step each) rather than long answers (one step per token): the
    same preemptions, evictions and recomputed prefixes in a fraction of the engine steps."""
    topics = ["hello world", "the quick brown fox", "cats sleep near warm windows", "rivers run"]
    return [
        (
            f"preempt-{i}",
            f"{SYSTEM}{topics[i % 4]} {i}" + "".join(f" {word}{i}" for word in FILLER),
            SamplingParams(max_tokens=24 + i % 5, temperature=0.0, logprobs=2),
        )
        for i in range(20)
    ]


@dataclass
class Run:
    finals: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, list[list[list[int]]]] = field(default_factory=dict)  # per output, per completion
    delta_tokens: list[int] = field(default_factory=list)
    delta_text: str = ""
    preemptions_mixed: int = 0
    preemptions_total: int = 0
    hit_rate_mixed: float = -1.0
    forward_tokens: int = 0  # tokens through the model (prefills shrink with cache hits)
    # (request, logical block) pairs a prefill reused although the block's K/V slots hold other tokens
    stale_blocks: set[tuple[str, int]] = field(default_factory=set)
    free_blocks_after: int = 0
    # Per request, the prompt tokens its latest prefill with a cache hit took from the cache, as the
    # scheduler handed them to the model runner (computed blocks x block size).
    cached_tokens: dict[str, int] = field(default_factory=dict)


def _drive(engine: Any, run: Run, arrivals: list[tuple[int, Request]]) -> None:
    pending = sorted(arrivals, key=lambda a: a[0])
    aborted = False
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, (request_id, prompt, params) = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            run.streams.setdefault(out.request_id, []).append([list(c.token_ids) for c in out.outputs])
            if out.request_id == "late-delta":
                run.delta_tokens += list(out.outputs[0].token_ids)
                run.delta_text += out.outputs[0].text
            if out.finished:
                run.finals[out.request_id] = out
        step += 1
        if not aborted and len(run.streams.get("abort", [])) >= ABORT_AFTER_OUTPUTS:
            engine.abort_request("abort")
            aborted = True


def _engine_args(path: str, steps: int, caching: bool) -> EngineArgs:
    return EngineArgs(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_scheduler_steps=steps,
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=caching,
        seed=0,
        disable_log_stats=True,
    )


class SlotAudit:
    """Which token, at which position, each K/V slot last received; checked against every reuse."""

    def __init__(self, engine: Any, run: Run) -> None:
        self.written: dict[int, tuple[int, int]] = {}
        self.run = run
        model = driver_model(engine)
        assert model is not None
        model.register_forward_pre_hook(self.record_writes, with_kwargs=True)
        scheduler = engine.scheduler[0]
        schedule = scheduler.schedule

        def schedule_and_check() -> Any:
            scheduled = schedule()
            for metadata in scheduled[0]:
                if metadata.is_prompt and metadata.computed_block_nums:
                    self.check(metadata)
            return scheduled

        scheduler.schedule = schedule_and_check

    def record_writes(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.run.forward_tokens += int(input_ids.numel())
        slots = get_forward_context().attn_metadata.slot_mapping.tolist()
        assert len(slots) == input_ids.numel(), "one K/V slot per input token"
        for slot, token, position in zip(slots, input_ids.tolist(), positions.tolist(), strict=True):
            if slot >= 0:
                self.written[slot] = (token, position)

    def check(self, metadata: Any) -> None:
        self.run.cached_tokens[metadata.request_id] = len(metadata.computed_block_nums) * BLOCK_SIZE
        computed = set(metadata.computed_block_nums)
        for seq_id, data in metadata.seq_data.items():
            tokens = data.get_token_ids()
            for logical, block in enumerate(metadata.block_tables[seq_id]):
                if block not in computed:
                    continue
                for offset in range(BLOCK_SIZE):
                    position = logical * BLOCK_SIZE + offset
                    if self.written.get(block * BLOCK_SIZE + offset) != (tokens[position], position):
                        self.run.stale_blocks.add((metadata.request_id, logical))
                        break


def _run(path: str, steps: int, caching: bool, *, vllm_fix: bool = True) -> Run:
    engine = build_engine(_engine_args(path, steps, caching))
    scheduler = engine.scheduler[0]
    if not vllm_fix:  # vLLM 0.8.5's own prefill pass, without engine.prefix_cache's correction
        scheduler._schedule_prefills = type(scheduler)._schedule_prefills.__get__(scheduler)
    run = Run()
    SlotAudit(engine, run)
    _drive(engine, run, _mixed_requests())
    run.preemptions_mixed = scheduler.num_cumulative_preemption
    run.hit_rate_mixed = prefix_cache_hit_rate(engine.scheduler)
    _drive(engine, run, [(0, r) for r in _preemption_requests()])
    run.preemptions_total = scheduler.num_cumulative_preemption
    run.free_blocks_after = scheduler.block_manager.get_num_free_gpu_blocks()
    del engine
    gc.collect()
    return run


@pytest.fixture(scope="module")
def demo_path() -> str:
    return str(demo_models.build("tiny-llama-bpe"))


@pytest.fixture(scope="module")
def runs(demo_path: str) -> Iterator[dict[tuple[int, bool], Run]]:
    yield {config: _run(demo_path, *config) for config in CONFIGS}


def _assert_logprobs_close(expected: Any, actual: Any, what: str) -> None:
    assert (expected is None) == (actual is None), what
    if expected is None:
        return
    assert len(expected) == len(actual), what
    for position, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert set(want) == set(got), f"{what} at {position}: top tokens differ"
        for token, logprob in want.items():
            assert abs(logprob.logprob - got[token].logprob) <= LOGPROB_TOLERANCE, f"{what} at {position}"


def _assert_same_greedy_tokens_up_to_a_tie(want: Any, got: Any, what: str) -> None:
    """Same greedy tokens, except that after a preemption they may part at a numerical tie.

    A preempted sequence is recomputed: without caching every token's K/V is recomputed by one
    prefill, with caching the blocks written token by token during decoding are reused. Both are
    right, and differ in the last float bits, which can flip a greedy choice between two tokens whose
    logprobs are equal to ~1e-5 on this random-weight demo model; a wrong K/V block changes them far
    more than that.
    """
    want_tokens, got_tokens = list(want.token_ids), list(got.token_ids)
    if want_tokens == got_tokens:
        return
    first = next(i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=False)) if a != b)
    candidates = want.logprobs[first]
    assert got_tokens[first] in candidates, f"{what}: token {first} is not the reference's runner-up"
    gap = abs(candidates[want_tokens[first]].logprob - candidates[got_tokens[first]].logprob)
    assert gap <= TIE_TOLERANCE, f"{what}: tokens part at {first} with a logprob gap of {gap}"


def test_workload_shares_whole_blocks_and_preempts(demo_path: str, runs: dict[tuple[int, bool], Run]) -> None:
    tokenizer = get_tokenizer(demo_path)
    assert len(tokenizer.encode(SYSTEM)) >= 3 * BLOCK_SIZE, "the system prompt must fill blocks to be cached"
    for config, run in runs.items():
        assert run.preemptions_mixed == 0, f"{config}: the mixed phase must not depend on preemption"
        assert run.preemptions_total > 0, f"{config}: the preemption phase must preempt"
        assert "abort" not in run.finals


def _assert_same_finals(reference: Run, run: Run, request_ids: set[str], what: str) -> None:
    for request_id in sorted(request_ids):
        want, got = reference.finals[request_id], run.finals[request_id]
        where = f"{what} {request_id}"
        for want_out, got_out in zip(want.outputs, got.outputs, strict=True):
            assert (got_out.finish_reason, got_out.stop_reason) == (want_out.finish_reason, want_out.stop_reason), where
            if request_id.startswith("preempt-"):
                _assert_same_greedy_tokens_up_to_a_tie(want_out, got_out, where)
            elif request_id != "late-delta":
                assert list(got_out.token_ids) == list(want_out.token_ids), where
                assert got_out.text == want_out.text, where
                _assert_logprobs_close(want_out.logprobs, got_out.logprobs, where)


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_same_outputs_and_streams_as_single_step_without_caching(
    runs: dict[tuple[int, bool], Run], config: tuple[int, bool]
) -> None:
    """Shared-prefix requests arriving inside running windows, a full-prompt hit, an abort, n=2."""
    reference, run = runs[(1, False)], runs[config]
    assert set(run.finals) == set(reference.finals), config
    mixed = {rid for rid in reference.streams if not rid.startswith("preempt-")}
    _assert_same_finals(reference, run, mixed & set(reference.finals), str(config))
    # Streamed outputs, one per token, hold the same tokens (aborted request included).
    assert {rid: run.streams[rid] for rid in mixed} == {rid: reference.streams[rid] for rid in mixed}, config
    assert (run.delta_tokens, run.delta_text) == (reference.delta_tokens, reference.delta_text), config
    assert len(run.streams["abort"]) == ABORT_AFTER_OUTPUTS


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_preempted_requests_match_single_step_without_caching(
    runs: dict[tuple[int, bool], Run], config: tuple[int, bool]
) -> None:
    reference, run = runs[(1, False)], runs[config]
    preempted = {rid for rid in reference.finals if rid.startswith("preempt-")}
    _assert_same_finals(reference, run, preempted, str(config))
    for request_id in preempted:
        assert len(run.streams[request_id]) == len(run.finals[request_id].outputs[0].token_ids), request_id


@pytest.mark.parametrize("config", CONFIGS)
def test_every_reused_block_holds_the_sequences_own_tokens(
    runs: dict[tuple[int, bool], Run], config: tuple[int, bool]
) -> None:
    assert runs[config].stale_blocks == set()


def test_vllm_0_8_5_alone_reuses_blocks_that_hold_other_tokens_after_preemption(demo_path: str) -> None:
    """What engine.prefix_cache corrects: the audit above catches vLLM's own scheduler reusing
    blocks another sequence overwrote (preempted requests, back through the waiting queue)."""
    run = _run(demo_path, 1, True, vllm_fix=False)
    assert run.preemptions_total > 0
    assert run.stale_blocks and all(request.startswith("preempt-") for request, _ in run.stale_blocks)


@pytest.mark.parametrize("steps", [1, 8])
def test_prefix_cache_is_hit_and_saves_prefill(runs: dict[tuple[int, bool], Run], steps: int) -> None:
    with_cache, without = runs[(steps, True)], runs[(steps, False)]
    assert without.hit_rate_mixed == -1.0
    assert with_cache.hit_rate_mixed > 0.3
    # Same number of generated tokens, fewer prompt tokens through the model.
    assert with_cache.forward_tokens < without.forward_tokens


@pytest.mark.parametrize("config", CONFIGS)
def test_a_finished_requests_timings_and_cached_tokens_are_the_engines_own(
    runs: dict[tuple[int, bool], Run], config: tuple[int, bool]
) -> None:
    """return_perf_metrics' values (engine/outputs.request_times): vLLM's RequestMetrics, in order, and
    the prompt tokens each prefill took from the cache as the scheduler handed them over (vLLM 0.8.5's
    CPU runner never recorded them: engine/prefix_cache.count_cached_prompt_tokens_on_cpu)."""
    run = runs[config]
    for request_id, final in run.finals.items():
        times = plain_output(final).times
        metrics = final.metrics
        assert times is not None and times[:4] == (
            metrics.arrival_time,
            metrics.first_scheduled_time,
            metrics.first_token_time,
            # Without a first token vLLM's last token time is still the arrival's: none.
            metrics.last_token_time if metrics.first_token_time is not None else None,
        ), request_id
        if len(final.outputs) > 1:
            # vLLM 0.8.5 runs n > 1 as n requests and never updates the assembled one's metrics:
            # it has no timings to give past the arrival (sent as -1, docs/interface.md).
            assert times[1:4] == (None, None, None), request_id
            continue
        assert times.arrival_time <= times.first_scheduled_time <= times.first_token_time <= times.last_token_time
        assert times.num_cached_tokens == run.cached_tokens.get(request_id, 0), request_id
    if config[1]:
        assert plain_output(run.finals["late-same-prompt"]).times.num_cached_tokens >= BLOCK_SIZE
    else:
        assert not run.cached_tokens


@pytest.mark.parametrize("config", CONFIGS)
def test_every_block_is_free_after_the_workload(runs: dict[tuple[int, bool], Run], config: tuple[int, bool]) -> None:
    # Cached blocks no sequence holds count as free (evictable): shared blocks were released.
    assert runs[config].free_blocks_after == NUM_BLOCKS


def test_block_size_stays_16_when_ipex_is_present(demo_path: str) -> None:
    args = _engine_args(demo_path, 8, True)
    args.block_size = None
    engine = build_engine(args)
    try:
        assert engine.cache_config.block_size == BLOCK_SIZE
    finally:
        del engine
        gc.collect()


def test_prefix_caching_is_refused_at_build_without_ipex(demo_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.attention.ops.ipex_attn as ipex_attn

    monkeypatch.setattr(ipex_attn, "_use_ipex", False)  # what vLLM sees when the import fails
    with pytest.raises(EngineBuildError, match="enable_prefix_caching=true needs Intel Extension for PyTorch"):
        build_engine(_engine_args(demo_path, 8, True))
