"""Multi-LoRA with the CPU multi-step runner: adapters and the base model in one batch, exact.

Real vLLM 0.8.5 engines (CPU multi-step at 8 steps, vLLM's own at 1) on the demo model with two
adapters constructed in PEFT's format (checks/adapters.py); the reference outside vLLM is transformers
with each adapter merged into the weights (W + alpha/r * B @ A). Every request (base, adapters,
greedy and seeded) gets the same tokens at 8 steps as at 1, as alone, and (greedy) as the merged
model; with one adapter slot the scheduler runs adapters in turn and nothing changes; rows without
an adapter beside an adapter in the last slot get no adapter (vLLM 0.8.5's CPU ops would give them
that slot's, engine/cpu_lora.py).
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path

import pytest
from vllm import EngineArgs, SamplingParams
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind

from triton_vllm_multistep.checks import adapters as lora
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.admission import lora_request
from triton_vllm_multistep.engine.cpu_lora import BaseRowsPunicaWrapperCPU
from triton_vllm_multistep.engine.factory import build_engine

MAX_TOKENS = 24
PROMPTS = {"base": [1, 5, 9, 12], "alpha": [1, 5, 9, 12], "beta": [3, 8, 2, 44, 17], "alpha-seeded": [7, 7, 1]}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build("tiny-llama-bpe")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": lora.write_adapter(model_dir, root / "alpha", seed=1, target_modules=lora.ATTENTION),
        "beta": lora.write_adapter(model_dir, root / "beta", seed=2, target_modules=(*lora.MLP, "q_proj")),
    }


def _lora(request_id: str, adapters: dict[str, Path]) -> LoRARequest | None:
    name = request_id.split("-")[0]
    if name not in adapters:
        return None
    # As the engine builds it from an EngineRequest's adapter: (name, lora_int_id, path).
    return lora_request((name, sorted(adapters).index(name) + 1, str(adapters[name])))


def _params(request_id: str) -> SamplingParams:
    seeded = request_id.endswith("seeded")
    return SamplingParams(
        temperature=1.0 if seeded else 0.0,
        seed=5 if seeded else None,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


def _engine(model_dir: Path, steps: int, max_loras: int) -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        num_scheduler_steps=steps,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
        max_cpu_loras=2,
    )
    return build_engine(args, stream_mode="step")


def _generate(engine: LLMEngine, request_ids: list[str], adapters: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Each request's deltas, all added at once (one batch)."""
    deltas: dict[str, list[list[int]]] = {request_id: [] for request_id in request_ids}
    for request_id in request_ids:
        prompt = TokensPrompt(prompt_token_ids=PROMPTS[request_id])
        engine.add_request(request_id, prompt, _params(request_id), lora_request=_lora(request_id, adapters))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids:
                deltas[output.request_id].append(list(output.outputs[0].token_ids))
    return deltas


def _tokens(deltas: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    return {request_id: [t for delta in d for t in delta] for request_id, d in deltas.items()}


@pytest.fixture(scope="module")
def runs(model_dir: Path, adapters: dict[str, Path]) -> dict[str, dict[str, list[list[int]]]]:
    """Every run the tests compare: mixed batches at 8 and 1 steps, 2 and 1 slots, and solo runs."""
    results = {}
    for steps, max_loras in ((8, 2), (1, 2), (8, 1)):
        engine = _engine(model_dir, steps, max_loras)
        try:
            results[f"mixed-{steps}-{max_loras}"] = _generate(engine, list(PROMPTS), adapters)
            if (steps, max_loras) == (8, 2):
                for request_id in PROMPTS:
                    results[f"solo-{request_id}"] = _generate(engine, [request_id], adapters)
        finally:
            engine.model_executor.shutdown()
    return results


def test_the_adapters_change_the_answers(runs: dict) -> None:
    tokens = _tokens(runs["mixed-1-2"])
    assert tokens["alpha"] != tokens["base"] and len(tokens["alpha"]) == MAX_TOKENS
    assert len({tuple(t) for t in tokens.values()}) == len(tokens)


@pytest.mark.parametrize("run", ["mixed-8-2", "mixed-8-1"])
def test_every_request_gets_the_tokens_of_single_step_decoding(runs: dict, run: str) -> None:
    assert _tokens(runs[run]) == _tokens(runs["mixed-1-2"])


def test_each_request_in_a_mixed_batch_equals_its_solo_run_and_streams_one_token_per_step(runs: dict) -> None:
    mixed = runs["mixed-8-2"]
    for request_id in PROMPTS:
        assert _tokens(runs[f"solo-{request_id}"])[request_id] == _tokens(mixed)[request_id], request_id
        assert all(len(delta) == 1 for delta in mixed[request_id]), request_id


@pytest.mark.parametrize("request_id", ["base", "alpha", "beta"])
def test_greedy_tokens_equal_transformers_with_the_adapter_merged_into_the_weights(
    runs: dict, model_dir: Path, adapters: dict[str, Path], request_id: str
) -> None:
    reference = lora.merged_model(model_dir, adapters.get(request_id))
    expected = lora.greedy_ids(reference, PROMPTS[request_id], MAX_TOKENS)
    assert _tokens(runs["mixed-8-2"])[request_id] == expected
    assert _tokens(runs["mixed-8-1"])[request_id] == expected


def test_vllms_cpu_ops_alone_would_give_base_rows_the_last_slots_adapter(
    model_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why engine/cpu_lora.py exists: with its correction undone, the base request beside an adapter
    request in a one-slot engine (steps 1, vLLM's own engine) no longer gets the base model's tokens."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    import triton_vllm_multistep.engine.cpu_lora as cpu_lora

    monkeypatch.setattr(cpu_lora, "BaseRowsPunicaWrapperCPU", PunicaWrapperCPU)
    engine = _engine(model_dir, 1, 1)
    try:
        uncorrected = _tokens(_generate(engine, ["base", "alpha"], adapters))
    finally:
        engine.model_executor.shutdown()
    reference = lora.greedy_ids(lora.merged_model(model_dir, None), PROMPTS["base"], MAX_TOKENS)
    assert uncorrected["base"] != reference
    assert issubclass(BaseRowsPunicaWrapperCPU, PunicaWrapperCPU)
