"""Helpers for tests that need a tritonserver of their own (destructive or specially configured).

Owns building a small model repository from the shipped LLM model, reading Prometheus text,
and finding the server's Python-backend stub processes; knows nothing about what is tested.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

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
    "copy_pipeline_stages",
    "make_repository",
    "metric",
    "model_ready",
    "readme_lora_repository",
    "readme_repository",
    "scrape",
    "stub_processes",
    "wait_for",
]
REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "vllm_model"


def make_repository(root: Path, models: dict[str, dict]) -> Path:
    """A repository of copies of the shipped LLM model, on the tiny demo model unless told otherwise.

    `models`: name → {"engine": model.json overrides, "parameters": config.pbtxt parameters}.
    """
    repository = root / "repository"
    repository.mkdir(parents=True)
    for name, spec in models.items():
        copy_model(SHIPPED_MODEL, repository / name, {**TINY_ENGINE, **spec.get("engine", {})}, spec.get("parameters"))
    return repository


def copy_pipeline_stages(repository: Path, tokenizer: str = TINY_MODEL) -> None:
    """The shipped ensemble and its tokenizer stages, the stages on `tokenizer`'s tokenizer."""
    for stage in ("preprocessing", "postprocessing", "ensemble"):
        shutil.copytree(SHIPPED_MODEL.parent / stage, repository / stage)
        config = repository / stage / "config.pbtxt"
        config.write_text(config.read_text().replace(REAL_MODEL, tokenizer))


def scrape(server: ServerProcess) -> str:
    return requests.get(server.metrics_url, timeout=10).text


def metric(text: str, name: str, model: str, **labels: str) -> float | None:
    """The value of one series (`name` with model=`model` and the given extra labels), or None."""
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found.get("model") == model and all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


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


def readme_repository(readme_path: str, target: Path) -> Path:
    """A repository made by the README's own commands (shell, from the project root) at `target`."""
    for command in readme_repository_commands(readme_path):
        subprocess.run(command.replace(readme_path, str(target)), shell=True, check=True, cwd=REPO_ROOT)
    return target


def readme_lora_repository(target: Path) -> Path:
    """The README's LoRA repository, made by its own commands at `target`."""
    return readme_repository("/tmp/lora_repository", target)
