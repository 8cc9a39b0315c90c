"""engine_v1/: vLLM's current engine (V1, .venv-v1) in its engine process, driven from this
environment (vLLM 0.8.5) through engine/process.py's messages, as a `vllm_engine: v1` model's stub
drives it.

Real V1 engine on the demo model under the V1 environment's Python; references from an offline
V1 `LLM` in that environment (a subprocess). No Triton (tests/e2e has the served checks).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from relay import Relay

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.checks.v1_reference import offline_v1_tokens, run_v1_script
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine import events
from triton_vllm_multistep.engine import process as engine_process
from triton_vllm_multistep.engine.events import (
    EngineBuildError,
    EngineRequest,
    KvCacheStats,
    RequestFailed,
    StepOutputs,
)
from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec
from triton_vllm_multistep.settings.v1_environment import PACKAGE_PARENT, v1_environment_python

REPO = Path(__file__).resolve().parents[2]
V1_PYTHON = v1_environment_python() or REPO / ".venv-v1" / "bin" / "python"
PROMPTS = ((1, 5, 9, 12), (3, 4, 5), (7, 8, 2, 2, 6))
DELTA = "DELTA"


def _fields() -> dict:
    model = str(demo_models.build("tiny-llama-bpe"))
    return {"model": model, "dtype": "float32", "max_model_len": 256, "seed": 0, "enforce_eager": True}


def _requests() -> list[EngineRequest]:
    common = {"ignore_eos": True, "output_kind": DELTA}
    return [
        EngineRequest("greedy", PROMPTS[0], {"max_tokens": 19, "temperature": 0.0, **common}),
        EngineRequest("seeded", PROMPTS[1], {"max_tokens": 13, "temperature": 0.8, "seed": 7, **common}),
        EngineRequest("logprobs", PROMPTS[2], {"max_tokens": 9, "temperature": 0.0, "logprobs": 2, **common}),
    ]


@pytest.fixture(scope="module")
def offline_v1() -> dict[str, list[int]]:
    """The same requests through V1's offline LLM, in the V1 environment."""
    return offline_v1_tokens(
        V1_PYTHON, _fields(), [(r.request_id, r.prompt_token_ids, r.sampling) for r in _requests()]
    )


@pytest.fixture(scope="module")
def v1_process() -> Iterator[Relay]:
    """One V1 engine process, served once, shared by the tests that need a working engine."""
    process = EngineProcess(EngineSpec(_fields(), "step"), python=str(V1_PYTHON), v1=True)
    process.start_engine()
    yield Relay(process)
    process.stop()


def test_the_v1_environment_has_vllms_current_engine_beside_this_one() -> None:
    assert V1_PYTHON.exists(), "scripts/setup.sh builds .venv-v1"
    script = "import vllm, numpy, transformers as t; print(vllm.__version__, numpy.__version__, t.__version__)"
    versions = subprocess.run(
        [str(V1_PYTHON), "-c", script], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    assert versions[0].startswith("0.32") and int(versions[1].split(".")[0]) >= 2, versions
    import vllm

    assert vllm.__version__.startswith("0.8.5")


def test_every_message_round_trips_between_the_two_pythons() -> None:
    """Each message type pickled here unpickles in the V1 environment and comes back equal (and
    the other way): nothing of either vLLM, torch or numpy is in them."""
    logprob = events.TokenLogprob(-0.5, 1, "a")
    adapter = ("a", 1, "/x")
    sampling = {"temperature": 0.0, "output_kind": DELTA, "logit_bias": {"3": 1.0}}
    completion = events.Completion(0, "a", [3], -0.5, [{3: logprob}], "length", None)
    messages = [
        EngineSpec(_fields(), "step", user_threads={"OMP_NUM_THREADS": None}, cpus=(1,), lora_adapters=(adapter,)),
        EngineRequest("r", (1, 2), sampling, adapter, (b"png",)),
        engine_process.Abort("r"),
        engine_process.Serve(0.25, True, True),
        engine_process.Stop(),
        engine_process.Built(events.EngineFacts("m", 10, 256, False, 1, "vLLM V1"), 2),
        engine_process.BuildFailed("ValueError: no"),
        engine_process.Stopped(),
        StepOutputs([events.EngineOutput("r", [completion], True, 2, 1.0)], 0.01),
        RequestFailed("r", "no"),
        events.EngineDied("gone", ["r"]),
        KvCacheStats(9, 10, 1, 0, 0.5, "a", ""),
    ]
    script = "import pickle, sys; sys.stdout.buffer.write(pickle.dumps(pickle.loads(sys.stdin.buffer.read())))"
    for message in messages:
        done = subprocess.run(
            [str(V1_PYTHON), "-c", script],
            input=pickle.dumps(message),
            capture_output=True,
            timeout=120,
            check=False,
            env={"PYTHONPATH": PACKAGE_PARENT, "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert pickle.loads(done.stdout) == message


def test_the_v1_engine_streams_one_output_per_step_with_offline_v1s_tokens(
    v1_process: Relay, offline_v1: dict[str, list[int]]
) -> None:
    facts = v1_process.process.facts
    assert facts.num_scheduler_steps == 1 and facts.max_model_len == 256 and facts.vocab_size > 0
    collector = EventCollector(expected=3)
    v1_process.to(collector.sink, collector.states.append)
    for request in _requests():
        v1_process.process.submit(request)
    assert collector.done.wait(300)
    assert collector.tokens == offline_v1
    # One token per delta: each decoded step reaches the stub on its own.
    assert all(len(d) == 1 for deltas in collector.deltas().values() for d in deltas)
    outputs = [o for e in collector.seen if isinstance(e, StepOutputs) for o in e.outputs]
    assert all(o.outputs[0].logprobs for o in outputs if o.request_id == "logprobs")
    assert collector.prompt_tokens == {r.request_id: len(r.prompt_token_ids) for r in _requests()}
    assert collector.states and all(isinstance(s, KvCacheStats) for s in collector.states)
    assert collector.states[-1].total_blocks > 0


def test_a_field_v1_removed_or_refuses_fails_its_request_alone_and_an_abort_ends_a_stream(v1_process: Relay) -> None:
    """vLLM 0.32's refusal of a field (its VLLMValidationError, no ValueError) fails that request alone,
    named by where its fields came from; the engine goes on."""
    collector = EventCollector(expected=3)  # best_of and top_p failed, short finished (an abort ends silently)
    v1_process.to(collector.sink)
    process = v1_process.process
    process.submit(EngineRequest("best_of", (1, 2), {"max_tokens": 4, "best_of": 3, "output_kind": DELTA}))
    top_p = {"max_tokens": 4, "top_p": 1.5, "output_kind": DELTA}
    process.submit(EngineRequest("top_p", (1, 2), top_p, sampling_source="parameters"))
    process.submit(EngineRequest("long", (1, 2, 3), {"max_tokens": 200, "ignore_eos": True, "output_kind": DELTA}))
    process.submit(EngineRequest("short", (4, 5), {"max_tokens": 30, "ignore_eos": True, "output_kind": DELTA}))
    process.abort("long")
    assert collector.done.wait(300)
    assert sorted(collector.failed) == ["best_of", "top_p"]
    assert collector.failed["best_of"].startswith("sampling_parameters: best_of=3: vLLM's V1 engine removed best_of")
    assert collector.failed["top_p"].startswith("parameters: top_p must be in (0, 1], got 1.5"), collector.failed
    assert collector.finished() == {"short"}
    assert sum(len(d) for d in collector.deltas().get("long", [])) < 200


def test_an_engine_argument_v1_refuses_is_the_build_error() -> None:
    process = EngineProcess(EngineSpec({**_fields(), "no_such_argument": 1}, "step"), python=str(V1_PYTHON), v1=True)
    with pytest.raises(EngineBuildError, match="refuses model.json's engine arguments: .*no_such_argument"):
        process.start_engine()
    process.stop()


_GPU_DECISIONS = """
import json, os, sys
from unittest import mock
from vllm.platforms import current_platform
from vllm.platforms.cpu import CpuPlatform
import vllm.v1.engine.llm_engine as llm_engine
from triton_vllm_multistep.engine.messages import EngineSpec
from triton_vllm_multistep.engine_v1 import cpu_async, cpu_lora, process
built = []
def from_engine_args(engine_args, stat_loggers=None, **kwargs):
    built.append(engine_args)
    return object()
found = {}
for name, fields in json.loads(sys.stdin.read()).items():
    with mock.patch.object(type(current_platform), "is_cpu", lambda self: False), \\
            mock.patch.object(llm_engine.LLMEngine, "from_engine_args", staticmethod(from_engine_args)):
        process.build_engine(EngineSpec(fields, "step"))
    found[name] = {
        "async_scheduling": built[-1].async_scheduling,
        "enable_lora": built[-1].enable_lora,
        "executor": built[-1].distributed_executor_backend,
        "environment": sorted(k for k in (cpu_async.KEEP_ENV, cpu_lora.FIX_ENV) if k in os.environ),
        "cpu_check_kept_async": getattr(CpuPlatform.check_and_update_config, "keeps_async_scheduling", False),
    }
print("GPU-DECISIONS", json.dumps(found))
"""


def test_on_a_gpu_platform_the_v1_engine_process_leaves_vllms_decisions_to_vllm() -> None:
    """The engine process's CPU-only steps, with the platform answering "not CPU" (vLLM 0.32's CUDA
    platform cannot be imported by its CPU build; its own GPU decisions are not simulated): an image
    model is not refused, no CPU fix is installed (the LoRA shrink, async scheduling kept, the worker
    moved into the core process), and
    `async_scheduling` goes to vLLM as model.json gives it (unset: vLLM decides, vllm/config/vllm.py
    turns it on where the executor supports it)."""
    image_model = str(demo_models.build("tiny-llava"))
    cases = {
        "image_model_lora": {"model": image_model, "enable_lora": True, "enforce_eager": True},
        "async_asked": {**_fields(), "async_scheduling": True},
    }
    stdout = run_v1_script(
        V1_PYTHON,
        _GPU_DECISIONS,
        (),
        json.dumps(cases),
        "the V1 GPU decisions script",
        {"PYTHONPATH": PACKAGE_PARENT},
    )
    (line,) = [line for line in stdout.splitlines() if line.startswith("GPU-DECISIONS ")]
    found = json.loads(line.removeprefix("GPU-DECISIONS "))
    assert found["image_model_lora"] == {
        "async_scheduling": None,
        "enable_lora": True,
        "executor": None,  # vLLM's own choice (its worker in the core process is the CPU fix)
        "environment": [],
        "cpu_check_kept_async": False,
    }
    assert found["async_asked"]["async_scheduling"] is True and found["async_asked"]["environment"] == []
    assert found["async_asked"]["cpu_check_kept_async"] is False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
