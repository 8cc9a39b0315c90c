"""What crosses between the stub and an engine process, besides engine/events.py's types: the spec
to build, the commands (Serve, Abort, Stop) and the replies (Built, BuildFailed, Stopped).

Owns these messages, how an engine process sends them (sender) and how a build failure crosses
(build_failure); imports nothing but the
standard library and the boundary types, so that both engine processes (the multi-step one in
this environment, engine/process.py; the V1 one in its own, engine_v1/) and the stub load them.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from triton_vllm_multistep.engine import events
from triton_vllm_multistep.engine.events import EngineEvent, EngineFacts, EngineRequest, KvCacheStats


@dataclass(frozen=True)
class EngineSpec:
    """Everything the child needs to build the engine, in plain values (unpickled before vLLM loads)."""

    engine_args: dict[str, Any]  # EngineArgs fields
    stream_mode: str
    user_threads: dict[str, str | None] = field(default_factory=dict)  # cpu_placement.thread_choice_of_user()
    use_ipex: bool = True
    cpus: tuple[int, ...] = ()  # config.pbtxt engine_cpus; empty: the CPUs it inherits
    # multi_lora.json's adapters as (name, lora_int_id, path), loaded once at start (warmup.preload_adapters)
    lora_adapters: tuple[tuple[str, int, str], ...] = ()
    # config.pbtxt max_prompt_tokens (0: max_model_len only), for prompts the engine tokenizes (V1)
    max_prompt_tokens: int = 0


@dataclass(frozen=True)
class Serve:
    """Stub → engine process: start stepping (EngineLoop.serve's settings; `report_state`: send KvCacheStats)."""

    state_interval: float
    time_steps: bool
    report_state: bool


@dataclass(frozen=True)
class Abort:
    """Stub → engine process: abort one request."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """Stub → engine process: shut the engine down and exit."""


@dataclass(frozen=True)
class Built:
    """Engine process → stub: the engine is built and warmed up."""

    facts: EngineFacts
    torch_threads: int | None


@dataclass(frozen=True)
class BuildFailed:
    """Engine process → stub: the build failed; its exception when that unpickles without vLLM, torch
    or numpy (ERROR_MODULES), else its type, message and traceback as text."""

    error: BaseException | str


@dataclass(frozen=True)
class Stopped:
    """Engine process → stub: the engine is shut down; nothing follows."""


# stub → engine process: EngineSpec first, then EngineRequest, Abort, Serve, Stop;
# engine process → stub: Built or BuildFailed first, then EngineEvents, KvCacheStats, Stopped last.
ToEngine = EngineSpec | EngineRequest | Abort | Serve | Stop
FromEngine = Built | BuildFailed | EngineEvent | KvCacheStats | Stopped


class EngineProcessError(RuntimeError):
    """The engine process failed to start or to build its engine (the message carries its error)."""


class NoPythonForEngineProcess(EngineProcessError):
    """No Python could start the engine process (none found, or it would not start)."""


# Modules whose exceptions unpickle without vLLM, torch or numpy: a build failure of theirs crosses as itself.
ERROR_MODULES = frozenset(
    {
        "builtins",
        events.__name__,
        __name__,
        "triton_vllm_multistep.engine.process",
        "triton_vllm_multistep.engine.cpu_placement",
        "triton_vllm_multistep.engine.ipex_switch",
        "triton_vllm_multistep.settings.parameters",  # ConfigError: model.json refused by the engine's vLLM
    }
)


def build_failure(error: BaseException) -> BuildFailed:
    """The message for a failed build: the exception itself where it may cross, else its text."""
    if type(error).__module__ in ERROR_MODULES:
        try:
            pickle.dumps(error)
            return BuildFailed(error)
        except Exception:
            pass
    return BuildFailed(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")


def sender(connection: Connection) -> Callable[[FromEngine], None]:
    """An engine process's send: any thread may call it; each message is pickled outside the lock,
    so a large step's outputs do not hold up another thread's message for their pickling."""
    lock = threading.Lock()

    def send(message: FromEngine) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            connection.send_bytes(data)

    return send
