"""engine/process.py: the engine in a process of its own gives the stub the same events as the
engine thread, and its failures (build, death) reach the stub as they would in-process.

Real CPU multi-step engine on the demo model, in a real child process; no Triton (tests/e2e has
the served check).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from relay import Relay

from triton_vllm_multistep.checks.collector import EventCollector
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.engine.events import EngineDied, EngineRequest, KvCacheStats, StepOutputs
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine
from triton_vllm_multistep.engine.loop import EngineLoop
from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec

STEPS = 8


def _fields(**extra: Any) -> dict[str, Any]:
    path = str(demo_models.build("tiny-llama-bpe"))
    return {"model": path, "dtype": "float32", "max_model_len": 256, "num_scheduler_steps": STEPS, "seed": 0, **extra}


def _requests() -> list[EngineRequest]:
    delta = "DELTA"
    return [
        EngineRequest(
            "greedy", (1, 5, 9, 12), {"max_tokens": 19, "temperature": 0.0, "ignore_eos": True, "output_kind": delta}
        ),
        EngineRequest("seeded", (3, 4, 5), {"max_tokens": 13, "temperature": 0.8, "seed": 7, "output_kind": delta}),
        EngineRequest("logprobs", (7, 8), {"max_tokens": 9, "temperature": 0.0, "logprobs": 2, "output_kind": delta}),
    ]


def _run(loop: Any, requests: list[EngineRequest]) -> EventCollector:
    collector = EventCollector(expected=len(requests))
    if isinstance(loop, Relay):  # served already
        loop.to(collector.sink, collector.states.append)
        loop = loop.process
    else:
        loop.serve(collector.sink, on_state=collector.states.append, time_steps=True)
    for request in requests:
        loop.submit(request)
    assert collector.done.wait(120)
    return collector


def _plain(value: Any) -> bool:
    """Whether `value` holds builtin values and the engine's boundary types only (no vLLM, torch or numpy)."""
    if type(value).__module__ not in ("builtins", "triton_vllm_multistep.engine.events"):
        return False
    if isinstance(value, dict):
        return all(_plain(key) and _plain(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return all(_plain(getattr(value, name)) for name in value.__dataclass_fields__)
    return True


@pytest.fixture(scope="module")
def in_process() -> EventCollector:
    args = _fields()
    from vllm import EngineArgs

    loop = EngineLoop(lambda: build_engine(EngineArgs(**args), stream_mode="step"))
    loop.start_engine()
    try:
        return _run(loop, _requests())
    finally:
        loop.shutdown()


def _started() -> EngineProcess:
    process = EngineProcess(EngineSpec(_fields(), "step"))
    process.start_engine()
    return process


@pytest.fixture(scope="module")
def shared_process() -> Iterator[Relay]:
    """Used in file order; test_stop_shuts_the_engine_process_down, its last user, stops it."""
    process = _started()
    yield Relay(process)
    process.stop()


@pytest.fixture
def engine_process() -> Iterator[EngineProcess]:
    process = _started()
    yield process
    process.stop()


def test_the_engine_process_streams_the_same_steps_as_the_engine_thread(
    in_process: EventCollector, shared_process: Relay
) -> None:
    engine_process = shared_process.process
    facts = engine_process.facts
    assert facts is not None and facts.num_scheduler_steps == STEPS and facts.max_model_len == 256
    assert engine_process.pid != os.getpid() and engine_process.torch_threads
    collected = _run(shared_process, _requests())
    # Same tokens, delivered as the same one-output-per-step deltas, FINAL last.
    assert collected.deltas() == in_process.deltas()
    assert all(len(d) == 1 for deltas in collected.deltas().values() for d in deltas)
    outputs = [o for e in collected.seen if isinstance(e, StepOutputs) for o in e.outputs]
    assert all(o.outputs[0].logprobs for o in outputs if o.request_id == "logprobs")
    assert collected.states and isinstance(collected.states[-1], KvCacheStats)
    # What crossed the pipe holds nothing of vLLM's, torch's or numpy's (as in the engine thread).
    assert all(_plain(event) for event in [*collected.seen, *collected.states])
    assert all(_plain(event) for event in [*in_process.seen, *in_process.states])
    assert engine_process.healthy and not any(isinstance(e, EngineDied) for e in collected.seen)


def test_an_aborted_request_ends_and_the_others_finish(shared_process: Relay) -> None:
    engine_process = shared_process.process
    collector = EventCollector(expected=1)
    aborted = threading.Event()

    def sink(event: Any) -> None:
        collector.sink(event)
        if not aborted.is_set() and "long" in collector.deltas():
            engine_process.abort("long")
            aborted.set()

    shared_process.to(sink)  # served already: as engine_process.serve(sink)
    delta = "DELTA"
    engine_process.submit(
        EngineRequest("long", (1, 2, 3), {"max_tokens": 200, "ignore_eos": True, "output_kind": delta})
    )
    engine_process.submit(EngineRequest("short", (4, 5), {"max_tokens": 40, "ignore_eos": True, "output_kind": delta}))
    assert collector.done.wait(120)
    assert collector.finished() == {"short"}
    assert sum(len(d) for d in collector.deltas()["long"]) < 200


def test_stop_shuts_the_engine_process_down(shared_process: Relay) -> None:
    """The shared process's last user: served (by the tests above, or the fixture), then stopped."""
    process = shared_process.process
    process.stop()
    assert process._process is not None and process._process.returncode == 0
    assert not process.healthy and process.error is None  # a stop is not a failure
    process.stop()  # idempotent


def test_a_killed_engine_process_fails_every_request_in_flight_once(engine_process: EngineProcess) -> None:
    collector = EventCollector(expected=99)
    started = threading.Event()

    def sink(event: Any) -> None:
        collector.sink(event)
        if isinstance(event, StepOutputs) and event.outputs:
            started.set()

    engine_process.serve(sink)
    params = {"max_tokens": 200, "ignore_eos": True}
    engine_process.submit(EngineRequest("a", (1, 2, 3), params))
    engine_process.submit(EngineRequest("b", (4, 5, 6), params))
    assert started.wait(60)
    assert engine_process.pid is not None
    os.kill(engine_process.pid, signal.SIGKILL)
    assert collector.done.wait(60)
    (died,) = [e for e in collector.seen if isinstance(e, EngineDied)]
    assert died.request_ids == ["a", "b"]
    assert "engine process exited" in died.message
    assert not engine_process.healthy and engine_process.error == died.message


def test_a_refused_setting_is_raised_in_the_stub_as_the_build_error() -> None:
    process = EngineProcess(EngineSpec(_fields(pipeline_parallel_size=2), "step"))
    with pytest.raises(EngineBuildError, match="pipeline"):
        process.start_engine()
    assert process._process is not None and process._process.poll() is not None


def _no_python_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a host without a Python for the engine process (tests/unit covers finding one)."""
    from triton_vllm_multistep.engine import process

    monkeypatch.setattr(process, "python_for_children", lambda: None)


def test_by_default_a_host_without_a_python_for_it_gets_the_engine_in_the_stub(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from triton_vllm_multistep.engine import engine_args as vllm_args
    from triton_vllm_multistep.settings import backend
    from triton_vllm_multistep.stub.instance import launch_engine_process, start_engine_runner

    _no_python_here(monkeypatch)
    settings = backend.BackendSettings()  # engine_process auto
    backend_logger = logging.getLogger("triton_vllm_multistep")  # does not propagate (the stub's log)
    backend_logger.addHandler(caplog.handler)
    try:
        process = launch_engine_process(settings, "llm")
    finally:
        backend_logger.removeHandler(caplog.handler)
    assert process is None
    assert "model llm: the engine runs in the stub (engine_process auto): could not start" in caplog.text
    values = _fields()
    runner = start_engine_runner(settings, values, vllm_args.to_engine_args(values), {}, process)
    try:
        assert isinstance(runner, EngineLoop) and runner.facts.num_scheduler_steps == STEPS
    finally:
        runner.shutdown()


def test_engine_process_true_without_a_python_for_it_is_a_load_error_saying_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from triton_vllm_multistep.engine.process import PYTHON_ENV
    from triton_vllm_multistep.settings import backend, parameters
    from triton_vllm_multistep.stub.instance import launch_engine_process

    _no_python_here(monkeypatch)
    settings = backend.BackendSettings(engine_process_required=True)
    with pytest.raises(parameters.ConfigError, match=f"model llm: engine_process is true but .* set {PYTHON_ENV}"):
        launch_engine_process(settings, "llm")


def test_launched_early_it_builds_once_given_the_spec_and_stops_at_once_without_one() -> None:
    """The stub launches the process before its own vLLM import and sends the spec when ready; a
    load that fails in between stops a process that never got anything to build."""
    from triton_vllm_multistep.engine import engine_args as vllm_args
    from triton_vllm_multistep.settings import backend
    from triton_vllm_multistep.stub.instance import launch_engine_process, start_engine_runner

    settings = backend.BackendSettings(use_ipex=False)
    unused = launch_engine_process(settings, "llm")
    assert unused is not None and unused.pid is not None
    unused.stop()
    assert unused._process is not None and unused._process.returncode is not None

    process = launch_engine_process(settings, "llm")
    values = _fields()
    runner = start_engine_runner(settings, values, vllm_args.to_engine_args(values), {}, process)
    try:
        assert runner is process and process.facts.num_scheduler_steps == STEPS
        assert process.facts.attention_kernels.startswith("PyTorch SDPA")  # launched with IPEX off
    finally:
        process.stop()


def test_a_spec_that_disagrees_with_the_launch_on_ipex_is_refused_naming_it() -> None:
    process = EngineProcess()
    process.launch(use_ipex=False)
    process.spec = EngineSpec(_fields(), "step", use_ipex=True)
    with pytest.raises(Exception, match="the engine process was started with use_ipex=False"):
        process.start_engine()
    process.stop()


def test_a_spec_that_disagrees_with_the_launch_on_cpus_is_refused_naming_it() -> None:
    cpu = max(os.sched_getaffinity(0))
    process = EngineProcess()
    process.launch(use_ipex=False)  # keeps the CPUs it inherits
    process.spec = EngineSpec(_fields(), "step", use_ipex=False, cpus=(cpu,))
    if os.sched_getaffinity(0) == {cpu}:
        pytest.skip("one CPU: every placement is the inherited one")
    with pytest.raises(Exception, match=f"not engine_cpus \\({cpu},\\)"):
        process.start_engine()
    process.stop()


def test_an_engine_launched_on_cpus_builds_there_with_one_torch_thread_per_cpu() -> None:
    cpu = max(os.sched_getaffinity(0))
    process = EngineProcess()
    process.launch(use_ipex=False, cpus=(cpu,))
    process.spec = EngineSpec(_fields(), "step", use_ipex=False, cpus=(cpu,))  # as the stub sends it
    try:
        process.start_engine()
        assert process.torch_threads == 1 and process.pid is not None
        assert set(cpu_placement.thread_cpus(process.pid).values()) == {(cpu,)}
    finally:
        process.stop()
