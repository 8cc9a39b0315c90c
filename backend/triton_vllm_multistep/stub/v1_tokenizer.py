"""A tokenizer stage's tokenizer in the V1 environment: config.pbtxt `vllm_engine: v1` on the stage.

Owns starting engine_v1/tokenizer_service.py under the V1 environment's Python (the stub's own
transformers may not load a tokenizer V1 serves) and `V1Tokenizer`, which answers the Preprocessor's
calls (`encode`, `apply_chat_template`) by asking that process: one request at a time (a lock: the
stage may run more than one thread), plain values only. The process ends with the stub (the
connection's end, or its parent's death signal).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from multiprocessing.connection import Connection
from typing import Any

from triton_vllm_multistep.settings.v1_environment import configured_v1_python, no_v1_environment, v1_environment

SERVICE_MODULE = "triton_vllm_multistep.engine_v1.tokenizer_service"
# How long the service may take to import transformers and load the tokenizer.
START_SECONDS = 120.0


class V1TokenizerError(RuntimeError):
    """The V1 environment's tokenizer could not be started or loaded; the message says why."""


def v1_python() -> str:
    python = configured_v1_python()
    if python is None:
        raise V1TokenizerError(no_v1_environment("vllm_engine 'v1' on a tokenizer stage"))
    return python


class V1Tokenizer:
    """The tokenizer in `folder`, loaded and run by a process under the V1 environment's Python."""

    def __init__(self, folder: str) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [v1_python(), "-m", SERVICE_MODULE, str(theirs.fileno()), folder],
                pass_fds=[theirs.fileno()],
                env=v1_environment(os.environ),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())
        self._lock = threading.Lock()
        if not self._connection.poll(START_SECONDS):
            self.close()
            raise V1TokenizerError(f"the V1 environment's tokenizer of {folder} did not load in {START_SECONDS:.0f} s")
        try:
            status, value = self._connection.recv()
        except (EOFError, OSError):
            status, value = "error", f"its process exited (code {self._process.wait(30)}; its output is in the log)"
        if status != "ok":
            self.close()
            raise V1TokenizerError(f"the V1 environment could not load the tokenizer of {folder}: {value}")
        self.kind = value  # the tokenizer's class, for the load's log line

    def _ask(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                self._connection.send((method, args, kwargs))
                status, value = self._connection.recv()
            except (EOFError, OSError):
                raise RuntimeError("the V1 environment's tokenizer process has ended") from None
        if status != "ok":
            raise ValueError(value)
        return value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._ask("encode", text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        return self._ask("apply_chat_template", messages, **kwargs)

    def close(self) -> None:
        self._connection.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)
