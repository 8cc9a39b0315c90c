"""Structured output (logits processors) on the GPU multi-step engine: one-step windows while a
constrained request runs, each run by vLLM's single-step path (engine/gpu_worker.py).

What is real: vLLM 0.8.5's LLMEngine.step, its V0 scheduler (our subclass), its multi-step output
processing and guided-decoding backends, the demo model, with num_scheduler_steps=8; the engine
class the GPU path builds (WindowClosingEngine). What stands in for CUDA: the worker. The engine
runs on the CPU multi-step worker, which hands a window's outputs over at its last step as vLLM's
MultiStepWorker does and runs a one-step window through vLLM's CPU runner, which samples and
pythonizes in the step as vLLM's single-step GPU runner does. The GPU worker's own decisions (its
runner subclass, the path a constrained window takes, TP broadcast of it) run under vLLM's CUDA
platform simulated, on vLLM's real MultiStepModelRunner class.
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import dataclasses
import json
import types
from typing import Any

import pytest
from simulated_cuda import simulated_cuda
from test_gpu_config_simulated import REPOSITORY, _build_config, _engine_args, _small
from vllm import EngineArgs, SamplingParams
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.sampling_params import GuidedDecodingParams, RequestOutputKind
from vllm.sequence import ExecuteModelRequest
from vllm.utils import resolve_obj_by_qualname

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine import gpu_worker
from triton_vllm_multistep.engine.cpu_multistep import WORKER_QUALNAME as CPU_WORKER_QUALNAME
from triton_vllm_multistep.engine.factory import EngineBuildError, cpu_multistep_config
from triton_vllm_multistep.engine.gpu_multistep import WindowClosingEngine

STEPS = 8
PROMPTS = {"choice": [1, 5, 9, 12], "json": [3, 8, 2], "plain": [1, 2, 3, 4, 5], "seeded": [7, 7, 1], "long": [9, 4]}
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "enum": ["x", "yy", "zzz"]}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def _params(request_id: str) -> SamplingParams:
    delta = RequestOutputKind.DELTA
    if request_id == "choice":
        guided = GuidedDecodingParams(choice=["alpha", "beta", "gamma"], backend="xgrammar")
        return SamplingParams(temperature=0, max_tokens=16, guided_decoding=guided, output_kind=delta)
    if request_id == "json":
        guided = GuidedDecodingParams(json=SCHEMA, backend="xgrammar:disable-any-whitespace")
        return SamplingParams(temperature=0, max_tokens=40, guided_decoding=guided, output_kind=delta)
    if request_id == "seeded":
        return SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True, output_kind=delta)
    # "long" runs on after the constrained requests end: its windows go back to STEPS steps.
    return SamplingParams(
        temperature=0, max_tokens=40 if request_id == "long" else 20, ignore_eos=True, output_kind=delta
    )


class WindowRecorder:
    """Wraps the executor: the length of every window started, and whether it held a constraint."""

    def __init__(self, engine: LLMEngine) -> None:
        self.windows: list[tuple[int, bool, list[str]]] = []
        self._execute = engine.model_executor.execute_model

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Any:
        groups = execute_model_req.seq_group_metadata_list
        if execute_model_req.is_first_multi_step:
            constrained = any(gpu_worker.has_logits_processors(m.sampling_params) for m in groups)
            self.windows.append((groups[0].state.num_steps, constrained, [m.request_id for m in groups]))
        return self._execute(execute_model_req)


def _run(engine: LLMEngine, order: list[list[str]]) -> dict[str, list[int]]:
    """Add each group of requests after a few steps of the previous one; all tokens per request."""
    tokens: dict[str, list[int]] = {}
    for group in order:
        for request_id in group:
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=PROMPTS[request_id]), _params(request_id))
            tokens[request_id] = []
        for _ in range(3):
            for output in engine.step():
                tokens[output.request_id].extend(output.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(demo_models.build("tiny-llama-bpe"))


@pytest.fixture(scope="module")
def single_step_tokens(model_path: str) -> dict[str, list[int]]:
    args = EngineArgs(model=model_path, dtype="float32", max_model_len=256, num_scheduler_steps=1)
    engine = LLMEngine.from_engine_args(args)
    try:
        return _run(engine, [["plain", "long"], ["choice", "json", "seeded"]])
    finally:
        engine.model_executor.shutdown()


@pytest.fixture(scope="module")
def gpu_engine_on_cpu(model_path: str) -> WindowClosingEngine:
    args = EngineArgs(model=model_path, dtype="float32", max_model_len=256, num_scheduler_steps=STEPS)
    config = cpu_multistep_config(args, stream_mode="window")
    config.scheduler_config.scheduler_cls = gpu_worker.SCHEDULER_QUALNAME
    engine = WindowClosingEngine.from_vllm_config(vllm_config=config, disable_log_stats=True)
    yield engine
    engine.model_executor.shutdown()


def test_the_cpu_worker_these_tests_run_on_is_one_the_engine_trusts_with_one_step_windows() -> None:
    assert CPU_WORKER_QUALNAME in gpu_worker.ONE_STEP_WINDOW_WORKERS


def test_constrained_requests_run_in_one_step_windows_and_every_request_keeps_its_single_step_tokens(
    gpu_engine_on_cpu: WindowClosingEngine, single_step_tokens: dict[str, list[int]]
) -> None:
    engine = gpu_engine_on_cpu
    assert engine.runs_logits_processors_exactly()
    recorder = WindowRecorder(engine)
    engine.model_executor.execute_model = recorder.execute_model
    try:
        tokens = _run(engine, [["plain", "long"], ["choice", "json", "seeded"]])
    finally:
        del engine.model_executor.execute_model
    assert tokens == single_step_tokens
    text = lambda ids: engine.get_tokenizer().decode(ids, skip_special_tokens=True)  # noqa: E731
    assert text(tokens["choice"]) in ("alpha", "beta", "gamma")
    assert set(json.loads(text(tokens["json"]))) == {"a", "b"}
    windows = recorder.windows
    assert any(constrained for _, constrained, _ in windows)
    assert all(steps == 1 for steps, constrained, _ in windows if constrained), windows
    # Unconstrained windows beside the constraint were one step too; before and after it, STEPS.
    first_constrained = next(i for i, w in enumerate(windows) if w[1])
    last_constrained = max(i for i, w in enumerate(windows) if w[1])
    assert any(steps == STEPS for steps, _, _ in windows[:first_constrained])
    assert any(steps == STEPS for steps, _, ids in windows[last_constrained + 1 :] if ids == ["long"])


def test_without_the_one_step_scheduler_vllm_refuses_the_request_as_before(model_path: str) -> None:
    args = EngineArgs(model=model_path, dtype="float32", max_model_len=256, num_scheduler_steps=STEPS)
    engine = WindowClosingEngine.from_vllm_config(vllm_config=cpu_multistep_config(args, "window"))
    try:
        assert not engine.runs_logits_processors_exactly()
        with pytest.raises(ValueError, match="not supported in multi-step decoding"):
            engine.add_request("c", TokensPrompt(prompt_token_ids=[1, 2]), _params("choice"))
    finally:
        engine.model_executor.shutdown()


def test_on_cuda_the_engine_runs_vllms_multi_step_worker_and_scheduler_extended_for_one_step_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.core.scheduler import Scheduler
    from vllm.worker.multi_step_worker import MultiStepWorker

    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, _small(args))
    assert vllm_config.parallel_config.worker_cls == gpu_worker.WORKER_QUALNAME
    assert vllm_config.scheduler_config.scheduler_cls == gpu_worker.SCHEDULER_QUALNAME
    assert issubclass(resolve_obj_by_qualname(gpu_worker.WORKER_QUALNAME), MultiStepWorker)
    assert issubclass(resolve_obj_by_qualname(gpu_worker.SCHEDULER_QUALNAME), Scheduler)
    engine = object.__new__(WindowClosingEngine)
    engine.scheduler_config, engine.parallel_config = vllm_config.scheduler_config, vllm_config.parallel_config
    engine.scheduler = [object.__new__(gpu_worker.OneStepWhileConstrainedScheduler)]
    assert engine.runs_logits_processors_exactly()


@pytest.mark.parametrize("name", ["worker_cls", "scheduler_cls"])
def test_on_cuda_a_worker_or_scheduler_of_the_users_is_a_load_error_naming_both(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    with simulated_cuda(), pytest.raises(EngineBuildError, match=f"{name}='my.Own' cannot be combined with num_sch"):
        _build_config(monkeypatch, dataclasses.replace(_small(args), **{name: "my.Own"}))


def _metadata(request_id: str, num_steps: int, params: SamplingParams) -> Any:
    from vllm.sequence import SequenceGroupMetadata, SequenceGroupState

    return SequenceGroupMetadata(
        request_id=request_id,
        is_prompt=False,
        seq_data={},
        sampling_params=params,
        block_tables={},
        state=SequenceGroupState(num_steps=num_steps),
    )


class BaseRunnerStandIn:
    """The GPU model runner MultiStepModelRunner wraps (CUDA only): what it was asked to do."""

    def __init__(self) -> None:
        self.sampler = types.SimpleNamespace(include_gpu_probs_tensor=True)
        self.executed: list[Any] = []

    def prepare_model_input(self, *_: Any) -> Any:
        attn = types.SimpleNamespace(num_prefills=0)
        return types.SimpleNamespace(
            query_lens=[1], seq_lens=[5], attn_metadata=attn, async_callback=None, as_broadcastable_tensor_dict=dict
        )

    def execute_model(self, frozen_model_input: Any, *_: Any) -> list[str]:
        self.executed.append(frozen_model_input)
        return ["single-step output"]


def _constrained_runner(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, BaseRunnerStandIn]:
    """vLLM's real MultiStepModelRunner made into ours, as BackendMultiStepWorker does, on a simulated
    GPU; the CUDA-only base runner it wraps is a stand-in."""
    from vllm.worker.multi_step_model_runner import MultiStepModelRunner
    from vllm.worker.worker import Worker

    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    base = BaseRunnerStandIn()
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, _small(args))
        base.vllm_config, base.is_driver_worker = vllm_config, True

        def worker_init(worker: Worker, *_: Any, **__: Any) -> None:  # Worker.__init__ needs a device
            worker.model_runner, worker.cache_config = base, vllm_config.cache_config
            worker.parallel_config = vllm_config.parallel_config

        monkeypatch.setattr(Worker, "__init__", worker_init)
        worker = gpu_worker.BackendMultiStepWorker()
    assert type(worker.model_runner) is gpu_worker.BackendMultiStepModelRunner
    assert isinstance(worker.model_runner, MultiStepModelRunner) and worker.model_runner._base_model_runner is base
    return worker.model_runner, base


def test_on_cuda_a_constrained_one_step_window_takes_vllms_single_step_path_and_tp_workers_are_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.worker.multi_step_model_runner import MultiStepModelRunner

    runner, base = _constrained_runner(monkeypatch)
    constrained = SamplingParams(max_tokens=4, logits_processors=[lambda ids, logits: logits])
    plain = SamplingParams(max_tokens=4)
    multi_step_calls: list[Any] = []
    monkeypatch.setattr(MultiStepModelRunner, "execute_model", lambda self, model_input, *a: multi_step_calls.append(1))

    window = [_metadata("c", 1, constrained), _metadata("p", 1, plain)]
    model_input = runner.prepare_model_input(window)
    assert model_input.is_multi_step is False
    assert model_input.as_broadcastable_tensor_dict()["is_multi_step"] is False  # what TP workers receive
    assert runner.execute_model(model_input, []) == ["single-step output"]
    assert base.executed == [model_input.frozen_model_input] and not multi_step_calls
    assert base.sampler.include_gpu_probs_tensor is False  # the sampler pythonizes in this step

    unconstrained = runner.prepare_model_input([_metadata("p", STEPS, plain)])
    assert unconstrained.is_multi_step is True
    runner.execute_model(unconstrained, [])
    assert multi_step_calls == [1] and len(base.executed) == 1  # vLLM's multi-step path, untouched

    with pytest.raises(RuntimeError, match=f"a scheduling window of {STEPS} steps holds a request with logits"):
        runner.prepare_model_input([_metadata("c", STEPS, constrained)])


def test_on_cuda_lora_with_multi_step_builds_and_adapter_management_reaches_the_runner_that_owns_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.8.5's MultiStepModelRunner passes only remove_all_loras to its base runner (the owner of
    the LoRA manager); ours passes add_lora, remove_lora, pin_lora and list_loras too, so that the
    engine can load each adapter at start (engine/warmup.preload_adapters) under multi-step."""
    from vllm.lora.request import LoRARequest
    from vllm.worker.multi_step_model_runner import MultiStepModelRunner

    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    lora_args = _small(args, enable_lora=True, max_loras=2, max_lora_rank=16)
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, lora_args)
    assert vllm_config.lora_config is not None and vllm_config.scheduler_config.num_scheduler_steps == STEPS
    assert "add_lora" not in vars(MultiStepModelRunner)  # vLLM's own would reach a manager that is None

    runner, base = _constrained_runner(monkeypatch)
    calls: list[tuple[str, Any]] = []
    base.add_lora = lambda request: calls.append(("add", request.lora_int_id)) or True
    base.remove_lora = lambda lora_id: calls.append(("remove", lora_id)) or True
    base.pin_lora = lambda lora_id: calls.append(("pin", lora_id)) or True
    base.list_loras = lambda: {1, 2}
    assert runner.add_lora(LoRARequest("doll", 1, "/adapters/doll")) is True
    assert runner.pin_lora(1) and runner.remove_lora(2) and runner.list_loras() == {1, 2}
    assert calls == [("add", 1), ("pin", 1), ("remove", 2)]
