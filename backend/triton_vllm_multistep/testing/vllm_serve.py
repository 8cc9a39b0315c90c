"""`vllm serve` (vLLM's own OpenAI API server) as the tests and benchmarks run it: the server users
would run instead, and the reference a model served through this backend must equal.

Owns its command line (engine arguments as its flags), starting it on a free port in a session of
its own under a given Python (this environment's vLLM 0.8.5, or the V1 environment's, whose `vllm`
script fails: `python -m vllm.entrypoints.openai.api_server`), waiting for it, finding its
processes, stopping it, and asking it for one completion's token ids and text, streamed or whole.
Knows nothing of what is asserted or measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vllm_multistep.testing import local_server


def serve_arguments(values: Mapping[str, Any]) -> list[str]:
    """`vllm serve` flags for engine arguments (all but `model`; None: vLLM's default): --name-with-dashes
    VALUE, mappings as JSON, true as the bare flag, false as --no-name (never dropped: where vLLM's
    default is true that would serve something else; where vLLM has no --no- form it refuses to start)."""
    arguments: list[str] = []
    for name, value in values.items():
        if name == "model" or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            arguments.append(flag)
        elif value is False:
            arguments.append("--no-" + name.replace("_", "-"))
        else:
            arguments += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return arguments


@dataclass
class VllmServe:
    """A running `vllm serve` (the parts of ServerProcess the benchmark uses, and completions)."""

    process: subprocess.Popen
    http_port: int
    log_path: Path
    served_name: str
    transport: str = "openai"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def is_ready(self) -> bool:
        import requests

        try:
            return requests.get(f"{self.http_url}/v1/models", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def process_groups(self) -> dict[str, list[Any]]:
        """The API server (under "tritonserver", the frontend's column) and its engine process(es)."""
        import psutil

        try:
            frontend = psutil.Process(self.process.pid)
            children = frontend.children(recursive=True)
        except psutil.NoSuchProcess:
            return {"tritonserver": [], "stub": [], "engine": []}
        return {"tritonserver": [frontend], "stub": [], "engine": children}

    def completion(
        self, prompt: str | Sequence[int], sampling: Mapping[str, Any], stream: bool
    ) -> tuple[list[int], str, int]:
        """openai_completion of this server's model."""
        return openai_completion(self.http_url, self.served_name, prompt, sampling, stream)

    def prompt_logprobs(
        self, prompt: str | Sequence[int], sampling: Mapping[str, Any]
    ) -> list[dict[str, float] | None]:
        """The prompt's logprobs of one /v1/completions request with `prompt_logprobs` in `sampling`:
        per position {token id (text): logprob}, None for the first token."""
        import requests

        body = {"model": self.served_name, "prompt": prompt if isinstance(prompt, str) else list(prompt), **sampling}
        response = requests.post(f"{self.http_url}/v1/completions", json=body, timeout=300)
        if response.status_code != 200:
            raise RuntimeError(f"vllm serve answered {response.status_code}: {response.text[:2000]}")
        (choice,) = response.json()["choices"]
        return [
            None if step is None else {token: entry["logprob"] for token, entry in step.items()}
            for step in choice["prompt_logprobs"]
        ]

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def _completion_choices(
    base_url: str, model: str, prompt: str | Sequence[int], sampling: Mapping[str, Any], stream: bool
) -> list[tuple[int, list[int], str]]:
    """Every choice or streamed choice chunk, (index, token ids, text) in the order received, of one
    /v1/completions request to an OpenAI server of vLLM 0.10+ (`return_token_ids`)."""
    import requests

    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt)}
    body.update({**sampling, "stream": stream, "return_token_ids": True})
    response = requests.post(f"{base_url}/v1/completions", json=body, stream=stream, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"{base_url} answered {response.status_code}: {response.text[:2000]}")
    if stream:
        chunks = [
            choice
            for line in response.iter_lines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"
            for choice in json.loads(line[len(b"data: ") :])["choices"]
        ]
    else:
        chunks = response.json()["choices"]
    return [(choice["index"], list(choice.get("token_ids") or []), choice.get("text") or "") for choice in chunks]


def openai_completion(
    base_url: str, model: str, prompt: str | Sequence[int], sampling: Mapping[str, Any], stream: bool
) -> tuple[list[int], str, int]:
    """(token ids, text, responses carrying tokens) of one /v1/completions request to an OpenAI server
    of vLLM 0.10+ (`return_token_ids`: vLLM serve of the V1 environment, or this backend's API for a V1
    model): the prompt as text or token ids, `sampling` as request fields (vLLM's names)."""
    chunks = _completion_choices(base_url, model, prompt, sampling, stream)
    if not stream:
        ((_, ids, text),) = chunks
        return ids, text, 1
    ids: list[int] = [token for _, new_ids, _ in chunks for token in new_ids]
    return ids, "".join(text for _, _, text in chunks), sum(bool(new_ids) for _, new_ids, _ in chunks)


def openai_choices(
    base_url: str, model: str, prompt: Sequence[int], sampling: Mapping[str, Any], stream: bool
) -> list[tuple[list[int], str]]:
    """Each choice's (token ids, text) of one /v1/completions request with n > 1 (by its index), to an
    OpenAI server of vLLM 0.10+ (`return_token_ids`), streamed chunks joined per choice."""
    joined: dict[int, tuple[list[int], str]] = {}
    for index, new_ids, text in _completion_choices(base_url, model, prompt, sampling, stream):
        ids, so_far = joined.get(index, ([], ""))
        joined[index] = (ids + new_ids, so_far + text)
    return [joined[index] for index in sorted(joined)]


def openai_chat(
    base_url: str, model: str, messages: Sequence[Mapping[str, str]], sampling: Mapping[str, Any], stream: bool
) -> tuple[str, int]:
    """(answer text, chunks carrying text) of one /v1/chat/completions request (the server's own chat template)."""
    import requests

    body = {"model": model, "messages": list(messages), **sampling, "stream": stream}
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, stream=stream, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"{base_url} answered {response.status_code}: {response.text[:2000]}")
    if not stream:
        return response.json()["choices"][0]["message"]["content"], 1
    text, chunks = "", 0
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[len(b"data: ") :])["choices"]:
            content = (choice.get("delta") or {}).get("content") or ""
            text += content
            chunks += bool(content)
    return text, chunks


def start_vllm_serve(
    python: str | Path,
    engine_values: Mapping[str, Any],
    served_name: str,
    log_path: Path,
    environment: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> tuple[VllmServe, float]:
    """`vllm serve` of `engine_values` (model.json's fields, `model` a folder) under `python` on a free
    port, the model named `served_name`; returns it and its seconds to ready, or raises naming its log."""
    (port,) = local_server.free_ports(1)
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine_values["model"])]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    command += serve_arguments(engine_values)
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(environment or {})},
            start_new_session=True,
        )
    server = VllmServe(process, port, log_path, served_name)
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}: see {log_path}")
        if server.is_ready():
            return server, time.monotonic() - started
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"vllm serve not ready within {timeout} s: see {log_path}")


@contextlib.contextmanager
def serving(
    python: str | Path,
    engine_values: Mapping[str, Any],
    served_name: str,
    log_path: Path,
    environment: Mapping[str, str] | None = None,
) -> Iterator[VllmServe]:
    """start_vllm_serve for the length of a with-block."""
    server, _ = start_vllm_serve(python, engine_values, served_name, log_path, environment)
    try:
        yield server
    finally:
        server.stop()
