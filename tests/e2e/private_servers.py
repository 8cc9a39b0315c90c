"""Helpers for tests that need a tritonserver of their own (destructive or specially configured).

Owns building a small model repository from the shipped LLM model, reading Prometheus text,
and finding the server's Python-backend stub processes; knows nothing about what is tested.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import requests
from served_models import REAL_MODEL, TINY_ENGINE, TINY_MODEL

from triton_vllm_multistep.engine.process import ENTRY_MODULE, V1_ENTRY_MODULE
from triton_vllm_multistep.lifecycle import procfs
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, start_ready_server
from triton_vllm_multistep.testing.polling import wait_for

__all__ = [
    "REPO_ROOT",
    "SHIPPED_MODEL",
    "add_models",
    "assert_the_drain_counted_the_streams_going",
    "copy_pipeline_stages",
    "drain_starts",
    "labels_of",
    "loaded_into",
    "make_repository",
    "metric",
    "model_ready",
    "readme_client_command",
    "readme_lora_repository",
    "readme_repository",
    "ready_lines",
    "scrape",
    "stub_of",
    "stub_processes",
    "stub_without_torch",
    "wait_for",
    "watch_as_a_router",
]
REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "vllm_model"


def make_repository(root: Path, models: dict[str, dict]) -> Path:
    """A repository of copies of the shipped LLM model, on the tiny demo model unless told otherwise.

    `models`: name → {"engine": model.json overrides, "parameters": config.pbtxt parameters}.
    """
    repository = root / "repository"
    repository.mkdir(parents=True)
    add_models(repository, models)
    return repository


def add_models(repository: Path, models: dict[str, dict]) -> None:
    """Copies of the shipped LLM model added to `repository`, as `make_repository` makes them."""
    for name, spec in models.items():
        copy_model(SHIPPED_MODEL, repository / name, {**TINY_ENGINE, **spec.get("engine", {})}, spec.get("parameters"))


@contextlib.contextmanager
def loaded_into(server: ServerProcess, models: Iterable[str]) -> Iterator[ServerProcess]:
    """A module's own models (already in its repository) loaded on a running server in explicit model
    control (the session's tiny server), one at a time, and unloaded on the way out, their stubs and
    engines gone before the next module loads its own: a module pays for its models, not for a
    server of its own."""
    import tritonclient.grpc as grpcclient

    names = list(models)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            for name in names:
                client.load_model(name)
            yield server
        finally:
            for name in names:
                client.unload_model(name)

            def stubs_gone() -> bool:
                return not any(server.running_with(f"/{name}/1/model.py") for name in names)

            assert wait_for(stubs_gone, 120), names


def stub_of(server: ServerProcess, model: str) -> psutil.Process:
    """`model`'s one Python-backend stub (its command line names the model's model.py)."""
    (stub,) = server.running_with(f"/{model}/1/model.py")
    return stub


def stub_without_torch(server: ServerProcess, model: str) -> float:
    """Assert `model`'s stub maps no libtorch (it imported neither torch nor vLLM); its resident memory
    in MB, a figure to print, not a bound."""
    stub = stub_of(server, model)
    assert "libtorch" not in Path(f"/proc/{stub.pid}/maps").read_text(), model
    return stub.memory_info().rss / 2**20


def ready_lines(server: ServerProcess, model: str) -> list[str]:
    """The backend's "model … ready" log lines of `model` on `server` (one per instance load)."""
    log = server.log_path.read_text(errors="replace")
    return [line for line in log.splitlines() if re.search(rf"model {re.escape(model)} \(.*?\) ready: ", line)]


def unloads(server: ServerProcess, model: str) -> int:
    """How often `server`'s log says `model` finished unloading (Triton's line, once its stubs ended)."""
    return server.log_path.read_text(errors="replace").count(f"successfully unloaded '{model}'")


def drain_starts(server: ServerProcess, model: str) -> list[tuple[float, int]]:
    """When `model`'s drains on `server` began (epoch seconds, from the log's local time to the
    millisecond) and how many requests each counted in flight."""
    pattern = re.compile(
        rf"(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) \[triton_vllm_multistep\] vllm_multistep: "
        rf"model {re.escape(model)}: .*?, with (\d+) request\(s\) in flight: new requests are refused"
    )
    log = server.log_path.read_text(errors="replace")
    return [
        (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(count))
        for stamp, count in pattern.findall(log)
    ]


def assert_the_drain_counted_the_streams_going(
    server: ServerProcess, model: str, since: float, finals_ns: Iterable[int]
) -> int:
    """`model`'s one drain after `since` (epoch s) counted at least one stream in flight and none whose
    FINAL the client had before the drain began: the check of a drain on unload that holds on a host
    of any speed. Only that bound: a stream can start seconds after another and end first, and a
    FINAL can reach the client long after the stub took its request out of its count (seen in a
    fresh-clone run: both FINALs 1.2 s after a drain that counted one, the two streams' last tokens
    made together), so a FINAL after the drain began does not show its stream was counted then. The stamps compare
    to about 0.5 s (the log's milliseconds). Returns the count."""
    ((started, counted),) = [drain for drain in drain_starts(server, model) if drain[0] > since]
    ended = [final / 1e9 for final in finals_ns]
    assert counted >= 1, "the drain began after every stream had ended"
    assert counted <= sum(end > started - 0.5 for end in ended), (
        started,
        counted,
        ended,
    )
    return counted


def copy_pipeline_stages(repository: Path, tokenizer: str = TINY_MODEL) -> None:
    """The shipped ensemble and its tokenizer stages, the stages on `tokenizer`'s tokenizer."""
    for stage in ("preprocessing", "postprocessing", "ensemble"):
        shutil.copytree(SHIPPED_MODEL.parent / stage, repository / stage)
        config = repository / stage / "config.pbtxt"
        config.write_text(config.read_text().replace(REAL_MODEL, tokenizer))


def add_v1_pipeline(repository: Path, llm: str, tokenizer: str, ensemble: str, preprocessing: str) -> None:
    """The ensemble over a `vllm_engine: v1` model as docs/ensemble.md writes it: the shipped
    preprocessing stage with `vllm_engine: v1` (its tokenizer in the V1 environment), then the model,
    whose text_output is the ensemble's (no postprocessing stage). Each edit of the shipped files is
    checked to apply, so a change there fails here, not silently."""

    def edited(text: str, edits: list[tuple[str, str]]) -> str:
        for old, new in edits:
            assert old in text, f"the shipped ensemble changed: {old!r} is gone"
            text = text.replace(old, new)
        return text

    shutil.copytree(SHIPPED_MODEL.parent / "preprocessing", repository / preprocessing)
    config = repository / preprocessing / "config.pbtxt"
    v1_parameter = 'parameters { key: "vllm_engine" value: { string_value: "v1" } }\n'
    config.write_text(
        edited(config.read_text(), [(f'"{REAL_MODEL}"', f'"{tokenizer}"'), ("input [", v1_parameter + "input [")])
    )
    shutil.copytree(SHIPPED_MODEL.parent / "ensemble", repository / ensemble)
    config = repository / ensemble / "config.pbtxt"
    text = edited(
        config.read_text(),
        [
            ('model_name: "preprocessing"', f'model_name: "{preprocessing}"'),
            ('model_name: "vllm_model"', f'model_name: "{llm}"'),
            ('      output_map { key: "output_ids" value: "output_ids" }\n',
             '      output_map { key: "output_ids" value: "output_ids" }\n'
             '      output_map { key: "text_output" value: "text_output" }\n'),
            ('      output_map { key: "input_ids" value: "_input_ids" }\n',
             '      output_map { key: "input_ids" value: "_input_ids" }\n'
             '      output_map { key: "exclude_input_in_output" value: "_exclude_input" }\n'),
            ('      input_map { key: "input_ids" value: "_input_ids" }\n',
             '      input_map { key: "input_ids" value: "_input_ids" }\n'
             '      input_map { key: "exclude_input_in_output" value: "_exclude_input" }\n'),
        ],
    )  # fmt: skip
    text = re.sub(r',\s*\{\s*model_name: "postprocessing".*?\n    \}', "", text, flags=re.S)
    assert 'postprocessing"' not in text
    text = "".join(line for line in text.splitlines(keepends=True) if not re.search(r"_return_window|_window_", line))
    config.write_text(text)


def scrape(server: ServerProcess) -> str:
    return requests.get(server.metrics_url, timeout=10).text


def metric(text: str, name: str, model: str, **labels: str) -> float | None:
    """The value of one series (`name` with model=`model` and the given extra labels), or None."""
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found.get("model") == model and all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


def labels_of(text: str, name: str, model: str) -> dict[str, str] | None:
    """The labels of the first series of `name` for `model` (an info gauge's), or None."""
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found.get("model") == model:
            return found
    return None


ROUTER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
# Request-level series the gateway's routers and Triton's vLLM backend PR 92 read, as deltas.
ROUTER_COUNTS = (
    "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
)


@dataclass
class RouterView:
    """What a router scraping the metrics endpoint saw while `run` ran: each gauge's highest value,
    and each count's change from before to after (once the engine was idle again)."""

    highest: dict[str, float]
    change: dict[str, float]
    cache_config: dict[str, str]
    result: Any

    def assert_filled_queued_and_preempted(self, requests: int, tokens_through_the_model: int) -> None:
        """What an overfilled KV cache shows a router: requests running and waiting, the cache mostly
        used; after: preemptions, one observation per request of each phase, and at least every
        prompt and generated token through the model once (preemption recomputes)."""
        assert self.highest["vllm:num_requests_running"] >= 2, self.highest
        assert self.highest["vllm:num_requests_waiting"] >= 1, self.highest
        assert self.highest["vllm:kv_cache_usage_perc"] > 0.5, self.highest
        change = self.change
        assert change["vllm:num_preemptions_total"] > 0, change
        for phase in ("queue", "inference", "prefill", "decode"):
            assert change[f"vllm:request_{phase}_time_seconds_count"] == requests, (phase, change)
        assert change["vllm:request_decode_time_seconds_sum"] > 0, change
        assert change["vllm:iteration_tokens_total_sum"] >= tokens_through_the_model, change


def watch_as_a_router(server: ServerProcess, model: str, run: Callable[[], Any], interval: float = 0.05) -> RouterView:
    """Scrape `model`'s router metrics every `interval` s while `run()` runs, as the Kubernetes gateway
    inference extension's model-server protocol reads them (Prometheus text, by name and model)."""

    def counts() -> dict[str, float]:
        text = scrape(server)
        return {name: metric(text, name, model) or 0.0 for name in ROUTER_COUNTS}

    before = counts()
    highest = dict.fromkeys(ROUTER_GAUGES, 0.0)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            text = scrape(server)
            for name in ROUTER_GAUGES:
                highest[name] = max(highest[name], metric(text, name, model) or 0.0)
            done.wait(interval)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = run()
    finally:
        done.set()
        poller.join(10)

    def idle() -> bool:
        text = scrape(server)
        return not metric(text, "vllm:num_requests_running", model) and not metric(
            text, "vllm:num_requests_waiting", model
        )

    assert wait_for(idle, 30), "the engine did not go idle"
    after: dict[str, float] = {}

    def settled() -> bool:  # flushed every 0.25 s: two scrapes that agree
        nonlocal after
        previous, after = after, counts()
        return previous == after

    assert wait_for(settled, 30, interval=0.6)
    info = labels_of(scrape(server), "vllm:cache_config_info", model) or {}
    return RouterView(highest, {name: after[name] - before[name] for name in ROUTER_COUNTS}, info, result)


def stub_processes(server: ServerProcess) -> list[psutil.Process]:
    """The server's live Python-backend stub processes (one per loaded model instance)."""
    return server.process_groups()["stub"]


def engine_processes(server: ServerProcess, model: str | None = None, v1: bool = False) -> list[psutil.Process]:
    """The server's engine processes (multi-step, or V1's with `v1`), of `model`'s stub only if named."""
    engines = server.running_with(V1_ENTRY_MODULE if v1 else ENTRY_MODULE)
    if model is None:
        return engines
    return [p for p in engines if f"/{model}/" in " ".join(procfs.cmdline(p.ppid()))]


def model_ready(server: ServerProcess, model: str) -> bool:
    try:
        return requests.get(f"{server.http_url}/v2/models/{model}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


@contextlib.contextmanager
def serving(repository: Path, log_path: Path, *server_args: str) -> Iterator[ServerProcess]:
    """A private server on `repository`, READY (a start that fails as start_ready_server retries is
    retried), stopped (drained) on the way out: a module fixture's body."""
    server, _ = start_ready_server(repository, log_path, *server_args, timeout=600)
    try:
        yield server
    finally:
        server.stop()


def readme_repository_commands(repository: str) -> list[str]:
    """The shell lines of the README block that makes `repository` (from its `cp -r model_repository`
    line up to the line that serves it)."""
    readme = (REPO_ROOT / "README.md").read_text()
    first = f"cp -r model_repository {repository}"
    block = readme.split(first, 1)[1].split("```", 1)[0]
    lines = []
    for line in block.splitlines():
        if line.startswith(".venv/bin/triton-vllm-multistep serve"):
            return [first, *lines]
        if line.strip():
            lines.append(line)
    raise AssertionError(f"the README block of {repository} has no serve line")


def readme_client_command(marker: str) -> list[str]:
    """The README's client example line holding `marker`, as argv (its quoted prompt kept whole)."""
    readme = (REPO_ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if marker in line and "grpc_stream" in line)
    args = command.split("grpc_stream.py", 1)[1].strip()
    quoted = re.match(r'"([^"]*)"\s*(.*)', args)
    assert quoted is not None, command
    return [sys.executable, "client_examples/grpc_stream.py", quoted.group(1), *quoted.group(2).split()]


def readme_repository(readme_path: str, target: Path) -> Path:
    """A repository made by the README's own commands (shell, from the project root) at `target`."""
    for command in readme_repository_commands(readme_path):
        subprocess.run(command.replace(readme_path, str(target)), shell=True, check=True, cwd=REPO_ROOT)
    return target


def readme_lora_repository(target: Path) -> Path:
    """The README's LoRA repository, made by its own commands at `target`."""
    return readme_repository("/tmp/lora_repository", target)
