"""`engine_process` through the real server: by default the engine runs in a process of its own, the
stream is the same one-response-per-step stream as with the engine in the stub (`engine_process:
false`), `engine_cpus` puts the engine process's threads on its CPUs and the stub's off them, and a
dead engine process fails its requests and its model alone.

Owns the served engine-process checks; must not assert on timings.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from private_servers import add_models, engine_processes, loaded_into, stub_of, stub_without_torch
from triton_clients import StreamResult, grpc_generate, make_inputs

from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.testing.local_server import ServerProcess
from triton_vllm_multistep.testing.polling import wait_for

IN_STUB = "llm_engine_in_stub"
OWN_PROCESS = "llm_engine_process"
PINNED = "llm_engine_pinned"
PROMPTS = ["hello world", "the quick brown fox", "cats sleep near warm windows"]


@pytest.fixture(scope="module")
def process_server(server: ServerProcess, model_repository: Path) -> Iterator[ServerProcess]:
    """The session's tiny server with this module's three models loaded (one engine is killed here)."""
    models = {
        IN_STUB: {"parameters": {"engine_process": "false"}},
        # Kept loaded once its engine is dead, as in default model control (the session server's is
        # explicit, where the model would take itself out of service: test_health_lifecycle.py).
        OWN_PROCESS: {"parameters": {"unload_on_engine_failure": "false"}},
        PINNED: {"parameters": {"engine_cpus": "last 1"}},  # = _engine_cpu()
    }
    add_models(model_repository, models)
    with loaded_into(server, models):
        yield server


def _generate(server: ServerProcess, model: str, prompt: str, stream: bool = True, **sampling: object) -> StreamResult:
    sampling = {"max_tokens": 20, **sampling}
    result = grpc_generate(server.grpc_url, model, prompt=prompt, sampling=sampling, stream=stream)
    assert result.error is None and result.finals == 1, (model, result.error)
    return result


def _engine_cpu() -> int:
    """The CPU the pinned model's engine gets: the last one this server may use."""
    return max(cpu_placement.allowed_cpus())


def test_the_engine_runs_in_its_own_process_and_streams_what_the_stub_engine_streams(
    process_server: ServerProcess,
) -> None:
    log = process_server.log_path.read_text(errors="replace")
    assert re.search(rf"model {OWN_PROCESS} \(.*?\) ready: .*engine in a process of its own", log)
    assert re.search(rf"model {IN_STUB} \(.*?\) ready: .*engine in the stub", log)
    # The default (and the pinned model's); not the model that set engine_process false.
    own = {model: len(engine_processes(process_server, model)) for model in (IN_STUB, OWN_PROCESS, PINNED)}
    assert own == {IN_STUB: 0, OWN_PROCESS: 1, PINNED: 1}, own
    for prompt in PROMPTS:
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}):
            want = _generate(process_server, IN_STUB, prompt, **sampling)
            got = _generate(process_server, OWN_PROCESS, prompt, **sampling)
            assert got.token_ids() == want.token_ids() and got.text() == want.text(), (prompt, sampling)
            # One response per decoded step, as in the stub.
            assert len(got.data_responses) == len(got.token_ids()) == len(want.data_responses)
            whole = _generate(process_server, OWN_PROCESS, prompt, stream=False, **sampling)
            # Non-streamed text starts with the prompt (Triton's vLLM backend's exclude_input_in_output false).
            assert whole.token_ids() == got.token_ids() and whole.text() == prompt + got.text()


def test_an_engine_process_checks_the_sampling_fields_in_the_words_of_the_stubs_checks(
    process_server: ServerProcess,
) -> None:
    """With the engine in a process of its own the stub imports neither vLLM nor torch (it maps no
    libtorch): vLLM's checks of the sampling fields run in the engine process, which refuses that
    request alone in the words the stub's own checks use with the engine in the stub."""
    print(f"{OWN_PROCESS} stub: {stub_without_torch(process_server, OWN_PROCESS):.0f} MB resident")
    assert "libtorch" in Path(f"/proc/{stub_of(process_server, IN_STUB).pid}/maps").read_text()
    errors: dict[str, tuple[str | None, str | None]] = {}
    for model in (IN_STUB, OWN_PROCESS):
        via_input = grpc_generate(process_server.grpc_url, model, prompt="hi", sampling={"top_p": 1.5}, stream=True)
        via_parameters = grpc_generate(
            process_server.grpc_url,
            model,
            inputs=make_inputs(grpcclient, prompt="hi", stream=True),
            parameters={"top_p": 1.5},
        )
        assert via_input.finals == via_parameters.finals == 1 and not via_input.data_responses
        errors[model] = (via_input.error, via_parameters.error)
        _generate(process_server, model, "hello world", temperature=0)  # the next request is served
    via_input_error, via_parameters_error = errors[OWN_PROCESS]
    assert via_input_error is not None and "sampling_parameters: top_p must be in (0, 1], got 1.5" in via_input_error
    assert via_parameters_error is not None and "parameters: top_p must be in (0, 1], got 1.5" in via_parameters_error
    assert "sampling_parameters" not in via_parameters_error, via_parameters_error
    assert errors[IN_STUB] == errors[OWN_PROCESS]


def test_engine_cpus_puts_every_engine_thread_on_its_cpus_and_the_stub_off_them(process_server: ServerProcess) -> None:
    cpu = _engine_cpu()
    log = process_server.log_path.read_text(errors="replace")
    ready = rf"model {PINNED} \(.*?\) ready: .*torch threads 1, engine in a process of its own on CPUs {cpu},"
    assert re.search(ready, log)
    (engine,) = engine_processes(process_server, PINNED)
    engine_threads = cpu_placement.thread_cpus(engine.pid)
    assert len(engine_threads) > 1 and set(engine_threads.values()) == {(cpu,)}, engine_threads
    others = tuple(c for c in cpu_placement.allowed_cpus() if c != cpu)
    stub_threads = cpu_placement.thread_cpus(engine.parent().pid)
    assert set(stub_threads.values()) == {others}, stub_threads
    # The unpinned model's processes keep every CPU.
    (unpinned,) = engine_processes(process_server, OWN_PROCESS)
    assert set(cpu_placement.thread_cpus(unpinned.parent().pid).values()) == {cpu_placement.allowed_cpus()}
    for prompt in PROMPTS:
        want = _generate(process_server, IN_STUB, prompt, temperature=0)
        got = _generate(process_server, PINNED, prompt, temperature=0)
        assert got.token_ids() == want.token_ids() and len(got.data_responses) == len(want.data_responses)
    # Threads the stub started while serving (the responder's) stay off the engine's CPU too.
    assert set(cpu_placement.thread_cpus(engine.parent().pid).values()) == {others}


def test_a_dead_engine_process_fails_its_requests_and_its_model_alone(process_server: ServerProcess) -> None:
    (engine,) = engine_processes(process_server, OWN_PROCESS)
    in_flight: list[StreamResult] = []
    first_response = threading.Event()

    def long_request() -> None:
        in_flight.append(
            grpc_generate(
                process_server.grpc_url,
                OWN_PROCESS,
                prompt="count to a thousand",
                sampling={"max_tokens": 200, "ignore_eos": True},
                stream=True,
                on_response=first_response.set,
                timeout=300,
            )
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    assert first_response.wait(120)
    engine.kill()
    thread.join(300)
    (stream,) = in_flight
    assert stream.finals == 1 and stream.error is not None and "engine process exited" in stream.error
    assert wait_for(lambda: not engine.is_running(), 30)
    after = grpc_generate(process_server.grpc_url, OWN_PROCESS, prompt="hello", sampling={"max_tokens": 4})
    assert after.finals == 1 and after.error is not None and "unhealthy vLLM engine" in after.error
    # The other model, and the server, go on.
    assert _generate(process_server, IN_STUB, "hello world", temperature=0).token_ids()
