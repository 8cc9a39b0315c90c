"""Closing dead multi-step windows on vLLM's own LLMEngine (the GPU engine), tested on CPU.

What is real here: vLLM 0.8.5's LLMEngine.step, its scheduler, its cached window
(SchedulerOutputState, SequenceGroupMetadata step state), abort and output processing, with
num_scheduler_steps=8 and the demo model loaded. What is simulated: the driver worker's
execute_model, which on a GPU is vLLM's MultiStepWorker (CUDA only). The stand-in follows that
worker's contract as vLLM's code defines it: a window starts on `is_first_multi_step`, non-last
steps return nothing to the engine, and the step with `is_last_step` returns one SamplerOutput per
step the window ran (MultiStepModelRunner._final_process_outputs, no async output processing).
"""

from __future__ import annotations

import os

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from vllm import EngineArgs, SamplingParams
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.sampling_params import RequestOutputKind
from vllm.sequence import CompletionSequenceGroupOutput, ExecuteModelRequest, Logprob, SequenceOutput

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.factory import cpu_multistep_config
from triton_vllm_multistep.engine.gpu_multistep import (
    WindowClosingEngine,
    finish_open_window,
    window_dead,
    window_open,
)

STEPS = 8
TOKEN = 7


class MultiStepWorkerStandIn:
    """The driver side of vLLM's MultiStepWorker as the engine sees it; records every request."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool, list[str]]] = []  # (first step, last step, request ids)
        self._window_steps = 0

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        req = execute_model_req
        self.calls.append(
            (req.is_first_multi_step, req.is_last_step, [m.request_id for m in req.seq_group_metadata_list])
        )
        self._window_steps = 1 if req.is_first_multi_step else self._window_steps + 1
        if not req.is_last_step:
            return []
        groups = req.seq_group_metadata_list
        step_output = lambda: SamplerOutput(  # noqa: E731
            outputs=[
                CompletionSequenceGroupOutput(
                    [SequenceOutput(next(iter(m.seq_data)), TOKEN, {TOKEN: Logprob(0.0)})], None
                )
                for m in groups
            ]
        )
        return [step_output() for _ in range(self._window_steps)]


@pytest.fixture(scope="module")
def engine() -> WindowClosingEngine:
    path = str(demo_models.build("tiny-llama-bpe"))
    args = EngineArgs(model=path, dtype="float32", max_model_len=256, num_scheduler_steps=STEPS)
    config = cpu_multistep_config(args, stream_mode="window")  # a real multi-step scheduler config
    built = WindowClosingEngine.from_vllm_config(vllm_config=config, disable_log_stats=True)
    yield built
    built.model_executor.shutdown()


@pytest.fixture()
def worker(engine: WindowClosingEngine, monkeypatch: pytest.MonkeyPatch) -> MultiStepWorkerStandIn:
    stand_in = MultiStepWorkerStandIn()
    monkeypatch.setattr(engine.model_executor, "execute_model", stand_in.execute_model)
    yield stand_in
    for scheduler in engine.scheduler:  # leave the engine empty and between windows
        for group in [*scheduler.running, *scheduler.waiting, *scheduler.swapped]:
            engine.abort_request(group.request_id)
    finish_open_window(engine)
    assert not window_open(engine) and not engine.has_unfinished_requests()


def _add(engine: LLMEngine, request_id: str, max_tokens: int = 100) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=[1, 5, 9, 12]), params)


def _into_window(engine: LLMEngine, worker: MultiStepWorkerStandIn, request_ids: list[str], steps: int) -> None:
    """Prefill `request_ids` (a one-step window) and run `steps` steps of their first decode window."""
    for request_id in request_ids:
        _add(engine, request_id)
    engine.step()
    for _ in range(steps):
        engine.step()
    assert window_open(engine) and worker.calls[-steps][0], "a decode window started"
    worker.calls.clear()


def test_vllms_own_step_runs_a_dead_windows_remaining_steps_first(
    engine: WindowClosingEngine, worker: MultiStepWorkerStandIn
) -> None:
    """The problem, on vLLM's LLMEngine.step itself: the next request waits for the dead window."""
    _into_window(engine, worker, ["a"], steps=2)
    engine.abort_request("a")
    assert window_dead(engine)
    _add(engine, "b")
    outputs = LLMEngine.step(engine)  # vLLM's step, without the backend's closing
    assert worker.calls == [(False, False, ["a"])] and not outputs  # the dead window's third step
    while window_open(engine):
        LLMEngine.step(engine)
    assert len(worker.calls) == STEPS - 2  # every remaining step ran before "b" was even scheduled


def test_a_window_whose_requests_were_aborted_ends_with_one_step_before_the_next_prefill(
    engine: WindowClosingEngine, worker: MultiStepWorkerStandIn
) -> None:
    _into_window(engine, worker, ["a"], steps=2)
    engine.abort_request("a")
    assert window_dead(engine)
    _add(engine, "b")
    outputs = engine.step()
    # One last step of the dead window (vLLM's last-step path), then b's prefill in the same call.
    assert worker.calls == [(False, True, ["a"]), (True, True, ["b"])]
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [("b", [TOKEN])]
    assert engine.cached_scheduler_outputs[0].seq_group_metadata_list is None  # vLLM cleared its cache


def test_an_idle_engine_closes_its_dead_window_at_once(
    engine: WindowClosingEngine, worker: MultiStepWorkerStandIn
) -> None:
    _into_window(engine, worker, ["a"], steps=1)
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and window_dead(engine)
    assert engine.close_window() == []
    assert worker.calls == [(False, True, ["a"])] and not window_open(engine)
    _add(engine, "b")
    engine.step()
    assert worker.calls[-1] == (True, True, ["b"])  # the next request starts with its own prefill


def test_a_window_with_a_live_request_is_not_cut_short(
    engine: WindowClosingEngine, worker: MultiStepWorkerStandIn
) -> None:
    _into_window(engine, worker, ["a", "b"], steps=1)
    engine.abort_request("a")
    assert window_open(engine) and not window_dead(engine)
    for _ in range(STEPS - 1):
        engine.step()
    assert [last for _, last, _ in worker.calls] == [False] * (STEPS - 2) + [True]
    group = engine.scheduler[0].running[0]
    assert group.request_id == "b" and group.seqs[0].get_output_len() == 1 + STEPS


def test_running_out_a_live_window_ends_it_with_its_tokens(
    engine: WindowClosingEngine, worker: MultiStepWorkerStandIn
) -> None:
    """finish_open_window on a live window (approach A): vLLM's own steps until the window ends."""
    _into_window(engine, worker, ["a"], steps=3)
    outputs = finish_open_window(engine)
    assert not window_open(engine) and len(worker.calls) == STEPS - 3 and worker.calls[-1][1]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [STEPS]  # the window's tokens, at its end
