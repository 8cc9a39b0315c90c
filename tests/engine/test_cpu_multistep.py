"""CPU multi-step engine on the tiny demo model: exactness against steps=1 and per-step outputs.

Owns the mixed workload and its comparisons; must not mock vLLM or assert on timings.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import EngineArgs, SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.sequence import SequenceData, SequenceGroupMetadata
from vllm.transformers_utils.detokenizer_utils import detokenize_incrementally
from vllm.transformers_utils.tokenizer import get_tokenizer

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.cpu_multistep import (
    CPUMultiStepEngine,
    FastIncrementalDetokenizer,
    advance_decode_input,
)
from triton_vllm_multistep.engine.factory import build_engine

STEPS = (1, 4, 8, 16)
LOGPROB_TOLERANCE = 5e-3
# Small enough that the preemption phase cannot fit, large enough for the mixed phase.
NUM_BLOCKS = 40
ABORT_AFTER_OUTPUTS = 3

Request = tuple[str, str, SamplingParams]


def _mixed_requests() -> list[tuple[int, Request]]:
    """(engine step at which it arrives, request) for the mixed-features phase.

    Stop conditions are chosen from the demo model's greedy continuations so that they fire;
    `_check_reference_exercises_workload` fails if the demo model changes and they no longer do.
    """
    greedy = {"temperature": 0.0}
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    return [
        (0, ("greedy", "hello world", SamplingParams(max_tokens=13, **greedy))),
        (0, ("seeded", "the quick brown fox", SamplingParams(max_tokens=14, seed=11, **sampled))),
        (0, ("temp", "numbers like 1 2 3", SamplingParams(max_tokens=10, temperature=1.3, seed=5))),
        # Greedy "the quick brown fox" continues " therec c 42 request..."
        (0, ("stop-str", "the quick brown fox", SamplingParams(max_tokens=20, stop=["42"], **greedy))),
        # Greedy "hello world" continues 502, 288, 26, 365, 496, ...
        (0, ("stop-id", "hello world", SamplingParams(max_tokens=20, stop_token_ids=[496], **greedy))),
        (
            0,
            (
                "min-tokens",
                "hello world",
                SamplingParams(max_tokens=12, min_tokens=7, stop_token_ids=[365], **greedy),
            ),
        ),
        # Seed 116 samples EOS as its 14th token.
        (
            0,
            (
                "eos",
                "cats sleep near warm windows",
                SamplingParams(max_tokens=24, temperature=1.5, top_k=40, seed=116),
            ),
        ),
        (
            0,
            (
                "ignore-eos",
                "cats sleep near warm windows",
                SamplingParams(max_tokens=18, temperature=1.5, top_k=40, seed=116, ignore_eos=True),
            ),
        ),
        (0, ("n2", "rivers run to the sea", SamplingParams(n=2, max_tokens=9, seed=3, **sampled))),
        (
            0,
            (
                "logprobs",
                "people write code",
                SamplingParams(max_tokens=11, logprobs=5, prompt_logprobs=3, **greedy),
            ),
        ),
        (0, ("abort", "bright stars in winter", SamplingParams(max_tokens=30, **greedy))),
        (
            0,
            (
                "delta",
                "the quick brown fox",
                SamplingParams(max_tokens=20, stop=["42"], output_kind=RequestOutputKind.DELTA, **greedy),
            ),
        ),
        # Greedy "people write code" repeats one token; penalties must see each step's token.
        (
            3,
            (
                "penalties",
                "people write code",
                SamplingParams(
                    max_tokens=17,
                    repetition_penalty=1.6,
                    frequency_penalty=0.8,
                    presence_penalty=0.5,
                    **greedy,
                ),
            ),
        ),
        (
            7,
            (
                "late-seeded-penalties",
                "people write code",
                SamplingParams(max_tokens=15, seed=21, frequency_penalty=1.0, **sampled),
            ),
        ),
    ]


def _preemption_requests() -> list[Request]:
    """More KV cache than NUM_BLOCKS holds: the scheduler must preempt (greedy, so recompute
    preemption cannot change the tokens)."""
    prompts = ["hello world", "the quick brown fox", "cats sleep near warm windows"]
    requests = []
    for i in range(12):
        params = SamplingParams(max_tokens=40 + i % 5, temperature=0.0, repetition_penalty=1.0 + 0.2 * (i % 3))
        requests.append((f"preempt-{i}", f"{prompts[i % 3]} {i}", params))
    return requests


@dataclass
class Run:
    """What one engine produced for the workload."""

    finals: dict[str, Any] = field(default_factory=dict)  # request id -> final RequestOutput
    counts: dict[str, int] = field(default_factory=dict)  # request id -> outputs yielded
    streamed_tokens: dict[str, list[int]] = field(default_factory=dict)  # last tokens seen
    # DELTA requests: tokens and text put together from every output.
    accumulated: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    preemptions_mixed: int = 0
    preemptions_total: int = 0
    log: list[str] = field(default_factory=list)


def _drive(engine: Any, run: Run, arrivals: list[tuple[int, Request]]) -> None:
    pending = sorted(arrivals, key=lambda a: a[0])
    aborted = False
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, (request_id, prompt, params) = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            run.counts[out.request_id] = run.counts.get(out.request_id, 0) + 1
            run.streamed_tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.request_id == "delta":
                tokens, text = run.accumulated.get("delta", ([], ""))
                run.accumulated["delta"] = (tokens + list(out.outputs[0].token_ids), text + out.outputs[0].text)
            if out.finished:
                run.finals[out.request_id] = out
        step += 1
        if not aborted and run.counts.get("abort", 0) >= ABORT_AFTER_OUTPUTS:
            engine.abort_request("abort")
            aborted = True


def _run_workload(engine: Any) -> Run:
    run = Run()
    _drive(engine, run, _mixed_requests())
    scheduler = engine.scheduler[0]
    run.preemptions_mixed = scheduler.num_cumulative_preemption
    _drive(engine, run, [(0, r) for r in _preemption_requests()])
    run.preemptions_total = scheduler.num_cumulative_preemption
    return run


def _engine_args(path: str, steps: int) -> EngineArgs:
    return EngineArgs(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_scheduler_steps=steps,
        num_gpu_blocks_override=NUM_BLOCKS,
        seed=0,
        disable_log_stats=True,
    )


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@pytest.fixture(scope="module")
def demo_path() -> str:
    return str(demo_models.build("tiny-llama-bpe"))


def _build_and_run(path: str, steps: int, stream_mode: str) -> tuple[Run, Any]:
    log: list[str] = []
    handler = _ListHandler(log)
    package_logger = logging.getLogger("triton_vllm_multistep")
    previous_level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        engine = build_engine(_engine_args(path, steps), stream_mode=stream_mode)
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)
    run = _run_workload(engine)
    run.log = log
    return run, engine


@pytest.fixture(scope="module")
def runs(demo_path: str) -> Iterator[dict[int, Run]]:
    """One engine per steps value (built, run, dropped one at a time to bound memory)."""
    results: dict[int, Run] = {}
    for steps in STEPS:
        run, engine = _build_and_run(demo_path, steps, stream_mode="step")
        results[steps] = run
        del engine
        gc.collect()
    yield results


def _check_reference_exercises_workload(reference: Run) -> None:
    finals = reference.finals
    assert finals["stop-str"].outputs[0].finish_reason == "stop"
    assert finals["stop-str"].outputs[0].stop_reason == "42"
    assert finals["stop-id"].outputs[0].stop_reason == 496
    assert finals["eos"].outputs[0].finish_reason == "stop"
    assert finals["eos"].outputs[0].stop_reason is None  # EOS
    assert finals["ignore-eos"].outputs[0].finish_reason == "length"
    assert 2 in finals["ignore-eos"].outputs[0].token_ids  # went past EOS
    assert len(finals["min-tokens"].outputs[0].token_ids) >= 7
    assert "abort" not in finals
    tokens, text = reference.accumulated["delta"]
    assert tokens == list(finals["stop-str"].outputs[0].token_ids)
    assert text == finals["stop-str"].outputs[0].text
    assert reference.preemptions_mixed == 0
    assert reference.preemptions_total > 0


def _assert_logprobs_close(expected: Any, actual: Any, what: str) -> None:
    assert (expected is None) == (actual is None), what
    if expected is None:
        return
    assert len(expected) == len(actual), what
    for position, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if want is None or got is None:
            assert want is got, f"{what} at {position}"
            continue
        assert set(want) == set(got), f"{what} at {position}: top tokens differ"
        for token, logprob in want.items():
            diff = abs(logprob.logprob - got[token].logprob)
            assert diff <= LOGPROB_TOLERANCE, f"{what} at {position}, token {token}: {diff}"


def _assert_same_results(reference: Run, run: Run, steps: int, streamed: bool = True) -> None:
    assert set(run.finals) == set(reference.finals), f"steps={steps}: finished requests differ"
    for request_id, want in reference.finals.items():
        got = run.finals[request_id]
        what = f"steps={steps} request {request_id}"
        assert len(got.outputs) == len(want.outputs), what
        for want_out, got_out in zip(want.outputs, got.outputs, strict=True):
            assert got_out.finish_reason == want_out.finish_reason, what
            assert got_out.stop_reason == want_out.stop_reason, what
            if request_id in reference.accumulated:
                continue  # DELTA: the last output's share depends on how outputs were grouped
            assert list(got_out.token_ids) == list(want_out.token_ids), what
            assert got_out.text == want_out.text, what
            _assert_logprobs_close(want_out.logprobs, got_out.logprobs, f"{what} logprobs")
        _assert_logprobs_close(want.prompt_logprobs, got.prompt_logprobs, f"{what} prompt logprobs")
    assert run.accumulated["delta"] == reference.accumulated["delta"], steps
    # The aborted request streamed the same tokens before it was aborted (when per step, the
    # abort lands after the same number of tokens; once per window, after a whole window).
    aborted = run.streamed_tokens["abort"]
    reference_aborted = reference.streamed_tokens["abort"]
    if streamed:
        assert aborted == reference_aborted, steps
        assert len(aborted) == ABORT_AFTER_OUTPUTS
    else:
        assert aborted[: len(reference_aborted)] == reference_aborted, steps


def test_reference_run_exercises_every_feature(runs: dict[int, Run]) -> None:
    _check_reference_exercises_workload(runs[1])


@pytest.mark.parametrize("steps", [s for s in STEPS if s > 1])
def test_multi_step_matches_single_step(runs: dict[int, Run], steps: int) -> None:
    run = runs[steps]
    assert run.preemptions_mixed == 0, "the mixed phase must not depend on preemption"
    assert run.preemptions_total > 0, "the preemption phase must preempt"
    _assert_same_results(runs[1], run, steps)


@pytest.mark.parametrize("steps", STEPS)
def test_one_output_per_generated_token(runs: dict[int, Run], steps: int) -> None:
    run = runs[steps]
    for request_id, final in run.finals.items():
        if request_id in run.accumulated:  # DELTA: each output holds only its new tokens
            assert run.counts[request_id] == len(run.accumulated[request_id][0]), request_id
        elif len(final.outputs) == 1:
            assert run.counts[request_id] == len(final.outputs[0].token_ids), request_id
    assert run.counts == runs[1].counts


@pytest.mark.parametrize("steps", [s for s in STEPS if s > 1])
def test_build_logs_cpu_multistep_runner(runs: dict[int, Run], steps: int) -> None:
    wanted = f"CPU multi-step runner in use: num_scheduler_steps={steps}"
    assert any(wanted in line for line in runs[steps].log), runs[steps].log


def test_single_step_uses_stock_engine(runs: dict[int, Run]) -> None:
    assert not any("CPU multi-step runner" in line for line in runs[1].log)


def test_window_outputs_without_per_step_streaming(demo_path: str, runs: dict[int, Run]) -> None:
    """stream_mode "window": same tokens (penalties still exact), fewer outputs."""
    run, engine = _build_and_run(demo_path, 8, stream_mode="window")
    del engine
    gc.collect()
    _assert_same_results(runs[1], run, 8, streamed=False)
    for request_id in ("greedy", "penalties", "eos"):
        assert run.counts[request_id] < runs[1].counts[request_id], request_id


@pytest.fixture(scope="module")
def engine16(demo_path: str) -> Iterator[CPUMultiStepEngine]:
    engine = build_engine(_engine_args(demo_path, 16))
    assert isinstance(engine, CPUMultiStepEngine)
    yield engine
    del engine
    gc.collect()


def _window_step(engine: CPUMultiStepEngine) -> int:
    return engine.driver_worker().model_runner.windows[0].step


def test_finished_window_is_not_walked(engine16: CPUMultiStepEngine) -> None:
    engine16.add_request("short", "hello world", SamplingParams(max_tokens=3, temperature=0.0))
    calls = 0
    while engine16.has_unfinished_requests():
        engine16.step()
        calls += 1
    # One prefill step and two decode steps, not the sixteen steps of the window.
    assert calls == 3
    assert _window_step(engine16) == 2
    assert engine16.cached_scheduler_outputs[0].seq_group_metadata_list is None


def test_aborted_window_is_not_walked(engine16: CPUMultiStepEngine) -> None:
    for i in range(2):
        engine16.add_request(f"ab{i}", "hello world", SamplingParams(max_tokens=50))
    engine16.step()  # prefill
    engine16.step()  # first decode step of a 16-step window
    assert _window_step(engine16) == 1
    engine16.abort_request(["ab0", "ab1"])
    assert engine16.step() == []
    assert _window_step(engine16) == 1  # no forward pass for the aborted window
    engine16.add_request("after", "hello world", SamplingParams(max_tokens=4, temperature=0.0))
    tokens = None
    while engine16.has_unfinished_requests():
        for out in engine16.step():
            tokens = out.outputs[0].token_ids
    assert tokens is not None and len(tokens) == 4


def _decode_metadata(seqs: list[tuple[list[int], list[int]]]) -> list[SequenceGroupMetadata]:
    groups = []
    for i, (tokens, blocks) in enumerate(seqs):
        data = SequenceData.from_seqs(tokens[:1], tokens[1:])
        data.update_num_computed_tokens(len(tokens) - 1)
        groups.append(
            SequenceGroupMetadata(
                request_id=str(i),
                is_prompt=False,
                seq_data={i: data},
                sampling_params=SamplingParams(temperature=0.0),
                block_tables={i: blocks},
            )
        )
    return groups


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(min_value=2, max_value=70), min_size=1, max_size=6),
    lookahead=st.integers(min_value=1, max_value=15),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_advance_matches_fresh_preparation(
    engine16: CPUMultiStepEngine, lengths: list[int], lookahead: int, seed: int
) -> None:
    """Advancing step k's input with its sampled tokens equals preparing step k+1 from scratch."""
    runner = engine16.driver_worker().model_runner
    block_size = runner.block_size
    rng = torch.Generator().manual_seed(seed)
    seqs = []
    next_block = 0
    for length in lengths:
        tokens = torch.randint(0, 2000, (length,), generator=rng).tolist()
        num_blocks = (length + lookahead + block_size - 1) // block_size
        # Shuffled, non-contiguous block ids, as a real block table would have.
        blocks = (torch.randperm(num_blocks, generator=rng) * 3 + next_block).tolist()
        next_block += 3 * num_blocks
        seqs.append((tokens, blocks))
    sampled = torch.randint(0, 2000, (len(seqs), 1), generator=rng)

    current = runner.prepare_model_input(_decode_metadata(seqs))
    advance_decode_input(current, sampled, block_size)
    grown = [([*tokens, int(t)], blocks) for (tokens, blocks), t in zip(seqs, sampled.view(-1), strict=True)]
    fresh = runner.prepare_model_input(_decode_metadata(grown))

    assert torch.equal(current.input_tokens, fresh.input_tokens)
    assert torch.equal(current.input_positions, fresh.input_positions)
    a, b = current.attn_metadata, fresh.attn_metadata
    assert torch.equal(a.slot_mapping, b.slot_mapping)
    assert torch.equal(a.seq_lens_tensor, b.seq_lens_tensor)
    assert a.max_decode_seq_len == b.max_decode_seq_len
    assert torch.equal(a.block_tables, b.block_tables)


def test_lean_request_output_matches_vllm(engine16: CPUMultiStepEngine) -> None:
    """The per-step output the engine builds itself equals vLLM's `from_seq_group` output."""
    requests = {
        "plain": SamplingParams(max_tokens=12, temperature=0.0),
        "logprobs": SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1, temperature=0.0),
        "stop-buffer": SamplingParams(max_tokens=12, stop=["zzzz"], temperature=0.0),
    }
    for request_id, params in requests.items():
        engine16.add_request(request_id, "the quick brown fox", params)
    for _ in range(4):  # the prefill, then into the decode window
        engine16.step()
    assert _window_step(engine16) == 3
    compared = 0
    for seq_group in list(engine16.scheduler[0].running):
        seq = seq_group.seqs[0]
        ours = engine16._request_output(seq_group, seq, seq_group.sampling_params, False)
        theirs = RequestOutput.from_seq_group(seq_group, False, {})
        assert ours is not None and theirs is not None
        assert vars(ours) == vars(theirs), seq_group.request_id
        compared += 1
    assert compared == len(requests)
    for request_id in requests:
        engine16.abort_request(request_id)
    engine16.step()


@pytest.fixture(scope="module", params=["tiny-llama-bpe", "tiny-llama-spm"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return get_tokenizer(str(demo_models.build(request.param)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=2047), min_size=1, max_size=12),
    generated=st.lists(
        st.one_of(st.integers(min_value=0, max_value=2047), st.sampled_from([0, 1, 2, 2100])),
        min_size=1,
        max_size=24,
    ),
    skip_special_tokens=st.booleans(),
)
def test_fast_detokenizer_matches_vllm(
    tokenizer: Any, prompt: list[int], generated: list[int], skip_special_tokens: bool
) -> None:
    fast = FastIncrementalDetokenizer(tokenizer)
    assert fast.usable
    ids = list(prompt)
    # Both start from vLLM's first iteration, as the engine does (the prefill's token).
    ids.append(generated[0])
    tokens, text, prefix, read = detokenize_incrementally(
        tokenizer, ids, None, 0, 0, skip_special_tokens=skip_special_tokens
    )
    theirs = (list(tokens), text, prefix, read)
    ours = (list(tokens), text, prefix, read)
    for token_id in generated[1:]:
        ids.append(token_id)
        t_tokens, t_text, t_prefix, t_read = detokenize_incrementally(
            tokenizer, ids, theirs[0], theirs[2], theirs[3], skip_special_tokens=skip_special_tokens
        )
        o_tokens, o_text, o_prefix, o_read = fast.step(ours[0], ours[2], ours[3], token_id, skip_special_tokens)
        assert (o_tokens, o_text, o_prefix, o_read) == (t_tokens, t_text, t_prefix, t_read)
        theirs = (theirs[0] + t_tokens, theirs[1] + t_text, t_prefix, t_read)
        ours = (ours[0] + o_tokens, ours[1] + o_text, o_prefix, o_read)
    assert ours == theirs
