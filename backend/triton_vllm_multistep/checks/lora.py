"""The smoke check's multi-LoRA section: base and adapters mixed in one batch on the multi-step engine.

Owns running the LoRA checks (mixed = alone = num_scheduler_steps 1, each adapter changes the
answer, = transformers with the adapter merged); adapters and references come from
checks/lora_reference.py.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.engines import PROMPT, describe_engine, greedy, in_engine_process, smoke_loop, submit
from triton_vllm_multistep.checks.lora_reference import (
    CONSTRUCTED_ADAPTERS,
    LORA_CHECKS,
    LORA_MAX_RANKS,
    LORA_RANK,
    _adapter_config,
    merged_verdict,
    no_constructed_adapters,
    no_merged_reference,
)
from triton_vllm_multistep.checks.report import SmokeReport, Stream


def _lora_requests(adapters: Sequence[tuple[str, int, str]]) -> dict[str, tuple[str, int, str] | None]:
    """Request id → adapter (name, lora_int_id, path) (None: the base model): the base first, then each adapter."""
    return {"lora-base": None, **{f"lora-{adapter[0]}": adapter for adapter in adapters}}


def _submit_each(runner: Any, requests: dict[str, Any], prompt: list[int], params: Callable[[], Any]) -> None:
    for request_id, adapter in requests.items():
        submit(runner, request_id, prompt, params(), adapter)


def run_lora_checks(
    report: SmokeReport,
    engine_args: Any,
    lora_adapters: Sequence[tuple[str, Path]] | None = None,
    transformers: str = "auto",
    user_threads: dict[str, str | None] | None = None,
) -> None:
    """The LoRA section: two adapters constructed for the model under test (checks/adapters.write_adapter,
    a Llama-style local model; else the checks are skipped, saying why) or the user's (`lora_adapters`),
    the engine built with enable_lora as the engine section builds it and the adapters loaded as the
    backend loads multi_lora.json's (engine/warmup.preload_adapters). Checks: the base and the adapters
    mixed in one batch (greedy, queued before the engine steps) each give their tokens alone; the
    tokens of the same engine at num_scheduler_steps 1 (in a process of its own, run first); each
    adapter changes the base model's answer; the tokens of transformers with the adapter merged
    (`transformers`: auto for models below TRANSFORMERS_MAX_PARAMS, on, off; else skipped, saying why)."""
    from triton_vllm_multistep.settings.lora import local_model_dir

    model_dir = local_model_dir(engine_args.model)
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-lora-") as root:
        if lora_adapters:
            adapters, source = list(lora_adapters), "--lora-adapters"
        else:
            reason = no_constructed_adapters(engine_args.model, model_dir)
            if reason is not None:
                for name in LORA_CHECKS:
                    report.skip(name, reason)
                return
            assert model_dir is not None
            from triton_vllm_multistep.checks import adapters as lora

            adapters = [
                (
                    name,
                    lora.write_adapter(model_dir, Path(root) / name, seed=seed, rank=LORA_RANK, target_modules=targets),
                )
                for name, (seed, targets) in CONSTRUCTED_ADAPTERS.items()
            ]
            source = f"constructed (checks/adapters.write_adapter, rank {LORA_RANK})"
        _lora_checks(report, engine_args, model_dir, adapters, source, transformers, user_threads)


def _lora_checks(
    report: SmokeReport,
    engine_args: Any,
    model_dir: Path | None,
    adapters: list[tuple[str, Path]],
    source: str,
    transformers: str,
    user_threads: dict[str, str | None] | None,
) -> None:
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.warmup import preload_adapters

    mixed_name, steps1_name, changed_name, merged_name = LORA_CHECKS
    needed = max(int(_adapter_config(folder).get("r") or 0) for _, folder in adapters)
    rank = next((r for r in LORA_MAX_RANKS if r >= needed), needed)
    if engine_args.enable_lora:
        rank = max(rank, engine_args.max_lora_rank)
    lora_args = dataclasses.replace(
        engine_args, enable_lora=True, max_loras=2, max_lora_rank=rank, max_cpu_loras=max(2, len(adapters))
    )
    plain = tuple((name, index + 1, str(folder)) for index, (name, folder) in enumerate(adapters))
    requests = _lora_requests(plain)
    max_tokens = engine_args.num_scheduler_steps + 4  # a prefill step, a whole window and a partial one: short on CPU
    prompt = PROMPT

    def params() -> dict[str, Any]:
        return greedy(max_tokens)

    lora_info = {
        "adapters": {name: str(folder) for name, folder in adapters},
        "source": source,
        "max_loras": 2,
        "max_lora_rank": rank,
    }
    print("LoRA:", json.dumps(lora_info), flush=True)

    # num_scheduler_steps 1, in a process of its own (exited before the in-process engine is built).
    started = time.perf_counter()
    try:
        reference = in_engine_process(
            lora_args,
            lambda runner, collector: collector.collect({request_id: Stream() for request_id in requests}),
            lora_adapters=plain,
            before_serve=lambda runner: _submit_each(runner, requests, prompt, params),
            num_scheduler_steps=1,
        )
    except Exception as error:
        failure = f"the num_scheduler_steps 1 engine failed: {type(error).__name__}: {error}"
        reference = {request_id: Stream(failure=failure) for request_id in requests}
    report.figures["lora_single_step_reference_seconds"] = time.perf_counter() - started

    started = time.perf_counter()
    loop = smoke_loop(lambda: preload_adapters(build_engine(lora_args, stream_mode="step"), plain), user_threads)
    try:
        engine = loop.start_engine()
    except Exception as error:
        failure = f"the engine with enable_lora failed to build: {type(error).__name__}: {error}"
        for name in LORA_CHECKS:
            report.check(name, False, failure)
        return
    report.figures["lora_build_seconds"] = time.perf_counter() - started
    try:
        report.engine["lora"] = lora_info
        if "engine" not in report.engine:
            report.engine.update(describe_engine(engine), torch_threads=loop.torch_threads)
            print("engine:", json.dumps(report.engine), flush=True)
        exact = str(engine.model_config.dtype) == "torch.float32"
        collector = EventCollector(engine)
        started = time.perf_counter()
        _submit_each(loop, requests, prompt, params)  # queued before the engine steps: one batch from the start
        loop.serve(collector.sink)
        mixed = collector.collect({request_id: Stream() for request_id in requests})
        alone: dict[str, Stream] = {}
        for request_id, adapter in requests.items():
            submit(loop, request_id, prompt, params(), adapter)
            alone[request_id] = collector.collect({request_id: Stream()})[request_id]
        report.figures["lora_generate_seconds"] = time.perf_counter() - started
    finally:
        loop.stop()
        engine.model_executor.shutdown()

    def tokens_of(stream: Stream) -> str:
        return f"{len(stream.tokens)} tokens" if stream.failure is None else f"failed: {stream.failure}"

    def token_list(stream: Stream) -> str:
        return str(stream.tokens) if stream.failure is None else f"failed: {stream.failure}"

    # 1. Mixed in one batch = alone.
    base_steps = mixed["lora-base"].steps
    equal_alone = {rid: stream.same_tokens(alone[rid], max_tokens) for rid, stream in mixed.items()}
    shared = {request_id: len(stream.steps & base_steps) for request_id, stream in mixed.items()}
    report.check(
        mixed_name,
        all(equal_alone.values()) and all(shared.values()),
        "; ".join(
            f"{request_id}: {tokens_of(stream)}, equal alone={equal_alone[request_id]}"
            + (f" (alone {tokens_of(alone[request_id])})" if not equal_alone[request_id] else "")
            + f", steps shared with lora-base {shared[request_id]}"
            for request_id, stream in mixed.items()
        ),
    )
    # 2. Mixed at num_scheduler_steps N = mixed at 1.
    equal_steps1 = {request_id: stream.same_tokens(reference[request_id]) for request_id, stream in mixed.items()}
    report.check(
        steps1_name,
        all(equal_steps1.values()),
        "; ".join(
            f"{request_id}: {tokens_of(stream)}, equal={equal_steps1[request_id]}"
            + (f" (steps 1: {reference[request_id].outcome()})" if not equal_steps1[request_id] else "")
            for request_id, stream in mixed.items()
        ),
    )
    # 3. Each adapter changes the base model's answer (same prompt).
    base = mixed["lora-base"]
    changed = {
        request_id: base.failure is None and stream.failure is None and stream.tokens != base.tokens
        for request_id, stream in mixed.items()
        if request_id != "lora-base"
    }
    report.check(
        changed_name,
        all(changed.values()),
        f"lora-base: {token_list(base)}; "
        + "; ".join(
            f"{request_id}: {token_list(mixed[request_id])}, changed={changed[request_id]}" for request_id in changed
        ),
    )
    # 4. Greedy tokens = transformers with the adapter merged (small models, on the host).
    reason = no_merged_reference(model_dir, adapters, transformers)
    if reason is not None:
        report.skip(merged_name, reason)
        return
    assert model_dir is not None
    folders = {f"lora-{name}": folder for name, folder in adapters}
    verdicts: dict[str, tuple[bool, str]] = {}
    started = time.perf_counter()
    for request_id, stream in mixed.items():
        if stream.failure is not None:
            verdicts[request_id] = (False, tokens_of(stream))
            continue
        try:
            verdicts[request_id] = merged_verdict(model_dir, folders.get(request_id), prompt, stream.tokens, exact)
        except Exception as error:
            verdicts[request_id] = (False, f"the transformers reference failed: {type(error).__name__}: {error}")
    report.figures["lora_transformers_seconds"] = time.perf_counter() - started
    report.check(
        merged_name,
        all(ok for ok, _ in verdicts.values()),
        "; ".join(f"{request_id}: {detail}" for request_id, (ok, detail) in verdicts.items()),
    )
