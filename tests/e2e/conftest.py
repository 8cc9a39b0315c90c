"""The end-to-end tier's fixtures: one real tritonserver (via the launcher) for the whole session.

The server serves a copy of the shipped model_repository/ on the tiny demo model (the shipped
one serves the real model, tested by test_real_model.py on a server of its own) plus test
variants of the LLM model (the other tokenizer; single-step scheduling; per-window streaming)
so both demo tokenizers are covered.

A second session server (`smollm2_lora_server`) serves the README's LoRA repository (the real
model with `pirate` and `shout`) plus a single-step copy, with the OpenAI API: the real-model
LoRA checks, the other real-model checks (test_real_model.py) and the OpenAI checks share it: the
only start of the real model in a session. Its `vllm_model` has LoRA on; base requests carry no adapter.

References outside Triton (offline vLLM, transformers, merged LoRA; references.py) are computed or
read from their disk cache once per session, before the first end-to-end test starts any server.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import references as reference_answers
import scheduling
import tritonclient.grpc as grpcclient
from private_servers import model_ready, readme_lora_repository, serving
from served_models import (
    LLM_MODEL,
    LLM_VARIANTS,
    OPENAI_API_KEY,
    REAL_MODEL,
    SHIPPED_REPOSITORY,
    STEPS1,
    TINY_ENGINE,
    TINY_MODEL,
)

from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, free_ports, start_ready_server

# The session servers started on this worker, by fixture name (stopped at their unit's end).
_SESSION_SERVERS: dict[str, ServerProcess] = {}


def _add_variant(repository: Path, name: str, overrides: dict) -> None:
    parameters = {"stream_mode": "window"} if name == "vllm_model_window" else None
    copy_model(repository / LLM_MODEL, repository / name, overrides, parameters)


def use_tiny_model(repository: Path) -> None:
    """Point the repository's LLM model and tokenizer stages at the tiny demo model (in place)."""
    llm = repository / LLM_MODEL
    if llm.exists():
        staging = repository.parent / f".{repository.name}-{LLM_MODEL}"
        copy_model(llm, staging, TINY_ENGINE)
        shutil.rmtree(llm)
        staging.rename(llm)
    for stage in ("preprocessing", "postprocessing"):
        config = repository / stage / "config.pbtxt"
        if config.exists():
            config.write_text(config.read_text().replace(REAL_MODEL, TINY_MODEL))


def _add_spm_pipeline(repository: Path) -> None:
    """ensemble_spm: the same pipeline on the metaspace demo tokenizer and vllm_model_spm."""
    for stage in ("preprocessing", "postprocessing"):
        target = repository / f"{stage}_spm"
        shutil.copytree(repository / stage, target)
        config = target / "config.pbtxt"
        config.write_text(config.read_text().replace("demo://tiny-llama-bpe", "demo://tiny-llama-spm"))
    target = repository / "ensemble_spm"
    shutil.copytree(repository / "ensemble", target)
    config = target / "config.pbtxt"
    text = config.read_text()
    for name in ("preprocessing", "postprocessing", "vllm_model"):
        text = text.replace(f'model_name: "{name}"', f'model_name: "{name}_spm"')
    config.write_text(text)


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> Path:
    repository = tmp_path_factory.mktemp("model_repository")
    shutil.rmtree(repository)
    shutil.copytree(SHIPPED_REPOSITORY, repository)
    # The embedding model is served by the SmolLM2 server (the README's repository): one engine less here.
    shutil.rmtree(repository / "embedding_model")
    use_tiny_model(repository)
    for name, overrides in LLM_VARIANTS.items():
        _add_variant(repository, name, overrides)
    _add_spm_pipeline(repository)
    return repository


@pytest.fixture(scope="session")
def server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real tritonserver (via the launcher) for every end-to-end test of the session. In explicit
    model control, every model of the repository loaded at the start: a module adds its own models
    to the repository and loads them (private_servers.loaded_into) instead of starting a server."""
    log_dir = tmp_path_factory.mktemp("server-log")
    explicit = ("--model-control-mode=explicit", "--load-model=*")
    handle, _ = start_ready_server(model_repository, log_dir / "tritonserver.log", *explicit)
    _SESSION_SERVERS["server"] = handle
    try:
        yield handle
    finally:
        handle.stop()
        if os.environ.get("CI"):
            print(f"\n--- tritonserver log tail ---\n{handle.log_tail(40)}")


@pytest.fixture(scope="session")
def smollm2_lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The README's LoRA repository made by its commands (the shipped repository on the real model,
    LoRA switched on by the README's sed: its `vllm_model` serves base requests, carrying no adapter,
    and the demo adapters), plus a single-step copy of its LLM model (LoRA on too), every model loaded
    (the ensemble too), with the OpenAI API (`--openai-port`, `--openai-api-key`)."""
    root = tmp_path_factory.mktemp("smollm2-lora")
    repository = readme_lora_repository(root / "lora_repository")
    assert '"enable_lora": true' in (repository / LLM_MODEL / "1" / "model.json").read_text()
    copy_model(repository / LLM_MODEL, repository / STEPS1, {"num_scheduler_steps": 1})
    (port,) = free_ports(1)
    args = (f"--openai-port={port}", f"--openai-api-key={OPENAI_API_KEY}", "--model-control-mode=explicit")
    with serving(repository, root / "tritonserver.log", *args, "--load-model=*") as server:
        # Raises with the log if the launcher stops instead (it does when the OpenAI server exits).
        server.wait_openai_ready()
        _SESSION_SERVERS["smollm2_lora_server"] = server
        yield server


@pytest.fixture
def smollm2_server(smollm2_lora_server: ServerProcess) -> ServerProcess:
    """The session's SmolLM2 LoRA server with its single-step copy loaded (loaded again if the OpenAI
    checks' unload ran first: it runs last of this server's users, see pytest_collection_modifyitems)."""
    if not model_ready(smollm2_lora_server, STEPS1):
        with grpcclient.InferenceServerClient(smollm2_lora_server.grpc_url) as client:
            client.load_model(STEPS1)
    return smollm2_lora_server


@pytest.fixture(scope="session")
def references() -> reference_answers.References:
    """Every reference answer outside Triton (references.py), cached on disk across sessions. The
    environment is left as found: vLLM's CPU platform writes thread settings into os.environ, which
    the session servers started next would inherit as if the user had chosen them."""
    environment = dict(os.environ)
    try:
        return reference_answers.compute_all()
    finally:
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(scope="session", autouse=True)
def references_before_servers(request: pytest.FixtureRequest) -> None:
    """The references, made before any server of the session starts (an offline engine beside a
    server would compete with it for the host's cores and memory), when a collected test uses them.
    Under xdist each worker collects every test but runs a share: there they are made when first
    used (references.compute_all lets one worker compute and the other read)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any("references" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("references")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stops_smollm2_model: unloads a model of smollm2_lora_server; runs after its other users"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that unloads a model of the SmolLM2 server runs after every other test using that
    server (a reload after it was seen to hold the server's stop for its whole exit timeout)."""
    _check_session_server_units(items)
    users = [i for i, item in enumerate(items) if "smollm2_lora_server" in getattr(item, "fixturenames", ())]
    stoppers = [item for item in items if item.get_closest_marker("stops_smollm2_model")]
    if not users or not stoppers:
        return
    last = users[-1]
    kept = [item for item in items[: last + 1] if item not in stoppers]
    items[:] = kept + stoppers + [item for item in items[last + 1 :] if item not in stoppers]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A session server stops once the last test of its unit (tests/scheduling.py) has run: its
    unit's modules run one after another on one worker, and nothing after them uses it; left running
    to the session's end it held ~10 GB (the SmolLM2 server) beside everything the worker ran next,
    which put the 24 GB host into the OOM killer (measured: 0.8 GB left, then a killed engine).
    Last of the teardown hooks: after pytest's own, which ends the module fixtures that unload
    their models from the server."""
    unit = scheduling.unit_of(item.nodeid)
    if unit not in scheduling.SESSION_SERVER_UNITS:
        return
    if nextitem is not None and scheduling.unit_of(nextitem.nodeid) == unit:
        return
    fixture, _ = scheduling.SESSION_SERVER_UNITS[unit]
    server = _SESSION_SERVERS.pop(fixture, None)
    if server is not None:
        server.stop()


def _check_session_server_units(items: list[pytest.Item]) -> None:
    """Every user of a session server is in its unit (tests/scheduling.py), so that xdist runs them on
    one worker and the server starts once per run; a module in two units would start both servers."""
    users: dict[str, set[str]] = {}
    for item in items:
        for unit, (fixture, _) in scheduling.SESSION_SERVER_UNITS.items():
            if fixture in getattr(item, "fixturenames", ()):
                users.setdefault(scheduling.module_of(item.nodeid), set()).add(unit)
    for module, units in sorted(users.items()):
        listed = scheduling.unit_of(module)
        if len(units) > 1 or listed not in units:
            raise pytest.UsageError(
                f"{module} uses the session server(s) of {', '.join(sorted(units))}: list it in that unit in "
                "tests/scheduling.py SESSION_SERVER_UNITS (one unit per module)"
            )
