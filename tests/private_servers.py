"""Helpers for tests that need a tritonserver of their own (destructive or specially configured).

Owns building a small model repository from the shipped LLM model, reading Prometheus text,
and finding the server's Python-backend stub processes; knows nothing about what is tested.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import requests

from triton_vllm_multistep.local_server import ServerProcess

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "vllm_model"


def make_repository(root: Path, models: dict[str, dict]) -> Path:
    """A repository of copies of the shipped LLM model.

    `models`: name → {"engine": model.json overrides, "parameters": config.pbtxt parameters}.
    """
    repository = root / "repository"
    repository.mkdir(parents=True)
    for name, spec in models.items():
        target = repository / name
        shutil.copytree(SHIPPED_MODEL, target)
        engine_path = target / "1" / "model.json"
        engine = json.loads(engine_path.read_text()) | spec.get("engine", {})
        engine_path.write_text(json.dumps(engine, indent=1))
        for config in (target / "config.pbtxt", target / "configs" / "cpu.pbtxt"):
            text = config.read_text()
            for key, value in spec.get("parameters", {}).items():
                line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
                text, replaced = re.subn(rf'^parameters \{{ key: "{key}" .*$\n', line, text, flags=re.M)
                if not replaced:
                    text += line
            config.write_text(text)
    return repository


def scrape(server: ServerProcess) -> str:
    return requests.get(server.metrics_url, timeout=10).text


def metric(text: str, name: str, model: str, **labels: str) -> float | None:
    """The value of one series (`name` with model=`model` and the given extra labels), or None."""
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found.get("model") == model and all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    """Poll `condition` until it holds (True) or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def stub_processes(server: ServerProcess) -> list[psutil.Process]:
    """The server's live Python-backend stub processes (one per loaded model instance)."""
    stubs = []
    for child in server.descendants():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "triton_python_backend_stub" in (child.cmdline() or [""])[0]:
                stubs.append(child)
        except psutil.NoSuchProcess:
            continue
    return stubs


def model_ready(server: ServerProcess, model: str) -> bool:
    try:
        return requests.get(f"{server.http_url}/v2/models/{model}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False
