"""engine/loop.py: the engine thread builds the engine, owns its torch threads and drives it.

Runs the real CPU multi-step engine on the demo model; no Triton here (the e2e suites cover it).
"""

from __future__ import annotations

import os
import threading
import time

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch
from vllm import EngineArgs, SamplingParams

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine
from triton_vllm_multistep.engine.loop import EngineLoop, RequestFailed, StepOutputs


def _args(steps: int = 4, **kwargs) -> EngineArgs:
    path = str(demo_models.build("tiny-llama-bpe"))
    return EngineArgs(model=path, dtype="float32", max_model_len=256, num_scheduler_steps=steps, **kwargs)


def test_the_engine_is_built_and_stepped_in_the_engine_thread_with_its_torch_threads() -> None:
    seen: dict[str, object] = {}
    events: list[object] = []
    finished = threading.Event()
    main_threads = torch.get_num_threads()

    def build():
        seen["thread"] = threading.current_thread().name
        return build_engine(_args(steps=4), stream_mode="step")

    def sink(event: object) -> None:
        events.append(event)
        if isinstance(event, StepOutputs) and any(o.finished for o in event.outputs):
            finished.set()

    # The loop applies its count once the engine is built, whatever the build left torch at.
    loop = EngineLoop(build, torch_threads=2)
    engine = loop.start_engine()
    try:
        assert seen == {"thread": "vllm-engine-loop"}
        assert loop.torch_threads == 2
        assert torch.get_num_threads() == main_threads  # the caller's threads are left alone
        assert loop.engine is engine and not loop.healthy  # built, not serving yet
        loop.serve(sink)
        assert loop.healthy
        loop.submit("r1", [1, 5, 9, 12], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert finished.wait(60)
        outputs = [o for e in events if isinstance(e, StepOutputs) for o in e.outputs]
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]  # one output per step
        assert outputs[-1].finished
        loop.submit("bad", [1, 10**7], SamplingParams(max_tokens=2))  # a token id outside the vocabulary
        deadline = time.monotonic() + 30
        while not any(isinstance(e, RequestFailed) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        failed = [e for e in events if isinstance(e, RequestFailed)]
        assert [e.request_id for e in failed] == ["bad"] and loop.healthy
    finally:
        loop.stop()
        engine.model_executor.shutdown()
    assert not loop.healthy


def test_a_build_error_reaches_the_caller_and_ends_the_thread() -> None:
    loop = EngineLoop(lambda: build_engine(_args(steps=8, enable_chunked_prefill=True)))
    with pytest.raises(EngineBuildError, match="chunked prefill"):
        loop.start_engine()
    assert not loop.healthy
    with pytest.raises(RuntimeError, match="not built"):
        _ = loop.engine
    loop.stop()  # harmless after a failed build
